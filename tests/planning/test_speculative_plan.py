"""The planner's rollout items under speculative rollouts (`rollout.speculative`), by hand for the small shape of
tests/planning/shapes.py: V 1000, E 64, I 128, H 4, K 2, D 16, 2 layers; 4 rows (2 prompts x G 2), S 6 + T 10 = L 16,
float32; 8 draft tokens, 64 verified positions, the default history bound."""

import dataclasses

from grpo_trainer.planning import INSTANTS, plan_memory
from grpo_trainer.rollout.backend import memory_profile
from grpo_trainer.rollout.settings import BackendChoice
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
from tests.planning.shapes import SETTINGS, SHAPE

ROLLOUT = INSTANTS.index("rollout")
SPECULATIVE = dataclasses.replace(SETTINGS, rollout=memory_profile(
    BackendChoice("fast", speculative=SpeculativeSettings(max_draft_tokens=8, max_verify_tokens=64)), "cpu"))


def test_the_cache_columns_and_the_verifying_forward_by_hand():
    plain, spec = (plan_memory(s, SHAPE) for s in (SETTINGS, SPECULATIVE))
    items = {i.name: i for i in plain.items}, {i.name: i for i in spec.items}
    # KV cache: 2 (k, v) x 2 layers x 4 rows x 2 heads x L x 16 x 4 B: 32,768 at L = 16, 49,152 at L = 16 + 8
    assert [i["KV cache"].bytes[ROLLOUT] for i in items] == [32_768, 49_152]
    # working set without drafts: the prefill of 2 distinct prompts, 4 B x 2 x 6 x (4 x 64 + 3 x 64) + 4 B x 12 x
    # 3 x 128 = 39,936, and 4 [4, V] float32 tensors of logits and softmax, 64,000: 103,936.
    # with: one layer over 64 positions, 4 B x 64 x (448 + 3 x 128) = 212,992, and 4 [64, V]: 1,024,000.
    assert [i["generation working set"].bytes[ROLLOUT] for i in items] == [103_936, 1_236_992]
    # host memory: the round's indexes, 4 rows x (16 + 8) tokens x 1,024 B = 98,304; the history's bound, 4 B x
    # 2^24 tokens + the cached indexes' 1,024 B x 2^16 tokens = 134,217,728, at every instant
    assert items[1]["speculative draft indexes"].bytes[ROLLOUT] == 98_304
    assert set(items[1]["speculative history"].bytes) == {134_217_728}
    assert items[1]["speculative history"].host and "speculative history" not in items[0]
    added = [a - b for a, b in zip(spec.totals(), plain.totals())]
    overhead = [[i["allocator overhead"].bytes[k] for i in items] for k in range(len(INSTANTS))]
    for k, extra in enumerate(added):  # and the allocator's share of it, at the instants this run has
        if not plain.occurs[k]:
            continue
        device = 16_384 + 1_133_056 + 98_304 if k == ROLLOUT else 0
        assert extra - (overhead[k][1] - overhead[k][0]) == device + 134_217_728


def test_a_family_outside_the_decoder_adds_nothing():
    other = dataclasses.replace(SHAPE, model_type="gpt2")  # the model's own forward or generate: no drafts
    assert plan_memory(SPECULATIVE, other).totals() == plan_memory(SETTINGS, other).totals()
