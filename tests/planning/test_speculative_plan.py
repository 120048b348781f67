"""The planner's rollout items under speculative rollouts (`rollout.speculative`), by hand for the small shape of
tests/planning/shapes.py: V 1000, E 64, I 128, H 4, K 2, D 16, 2 layers; 4 rows (2 prompts x G 2), S 6 + T 10 = L 16,
float32; 8 draft tokens, 64 verified positions."""

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
    added = [a - b for a, b in zip(spec.totals(), plain.totals())]
    overhead = [i["allocator overhead"].bytes[ROLLOUT] for i in items]
    assert added[ROLLOUT] - (overhead[1] - overhead[0]) == 16_384 + 1_133_056  # and the allocator's share of it
    assert all(a == 0 for k, a in enumerate(added) if k != ROLLOUT)


def test_a_family_outside_the_decoder_adds_nothing():
    other = dataclasses.replace(SHAPE, model_type="gpt2")  # the model's own forward or generate: no drafts
    assert plan_memory(SPECULATIVE, other).totals() == plan_memory(SETTINGS, other).totals()
