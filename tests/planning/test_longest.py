"""How long a completion fits: the planner grows with T within each segment of what the round's replay tensors keep,
the search returns the planner's own boundary (it fits, one token more does not), crosses the replay cap where the
plan drops, and lists the settings that reach longer with the lengths the planner gives them."""

import dataclasses

import pytest
from transformers import Qwen2Config

from grpo_trainer.planning import DeviceMemory, longer_settings, longest_completion, model_shape, plan_memory
from grpo_trainer.planning.longest import _kept_rank, _segments
from tests.planning.shapes import SETTINGS, SHAPE, rollout

# Qwen2.5-0.5B's widths and vocabulary with 2 layers (benchmarks/shapes.py's proxy), from its config on meta.
PROXY = model_shape(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True), None)
PROXY_SETTINGS = dataclasses.replace(SETTINGS, micro_batch=2, num_generations=2, prompt_length=8,
                                     completion_length=4096)


def _bytes(settings, shape, T):
    return plan_memory(dataclasses.replace(settings, completion_length=T), shape).device_bytes


def _device(size):
    return DeviceMemory("cpu", int(size), "test")


SETUPS = {
    "fast": PROXY_SETTINGS,
    "fast, 4 micro-steps a round": dataclasses.replace(PROXY_SETTINGS, steps_per_generation=4, accumulation_steps=4),
    "fast, no checkpointing": dataclasses.replace(PROXY_SETTINGS, checkpointing=False),
    "generate, beta": dataclasses.replace(PROXY_SETTINGS, rollout=rollout("generate"), beta=0.04),
    "cuda bf16": dataclasses.replace(PROXY_SETTINGS, device="cuda", mixed_precision="bfloat16"),
    "off-policy, entropy bonus": dataclasses.replace(PROXY_SETTINGS, steps_per_generation=2, entropy_gradient=True),
    "ZeRO-3": dataclasses.replace(PROXY_SETTINGS, device="cuda", zero_stage=3, processes=2),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_plan_grows_with_T_within_each_replay_segment(setup):
    """Decision 1, swept: the kept-replay rank never decreases with T, and within a rank the plan never does."""
    settings = SETUPS[setup]
    grid = sorted({*range(1, 2000, 37), *(int(1.3 ** k) for k in range(20, 58))}
                  | {T + d for a, b in _segments(settings, PROXY, 1 << 22) for T in (a, b) for d in (-1, 0, 1)}
                  - {0})
    previous_rank, previous_bytes = -1, 0
    for T in grid:
        rank, size = _kept_rank(settings, PROXY, T), _bytes(settings, PROXY, T)
        assert rank >= previous_rank, T
        if rank == previous_rank:
            assert size >= previous_bytes, T
        previous_rank, previous_bytes = rank, size


def test_the_longest_completion_is_the_planners_own_boundary():
    """No replay tensors (generate): one segment. A budget of exactly the plan at T = 500 gives 500; a byte less
    gives 499 (the plan grows by at least a byte a token); under the plan at T = 1, none."""
    settings = dataclasses.replace(SETTINGS, rollout=rollout("generate"))
    assert _segments(settings, SHAPE, 1 << 22) == [(1, 1 << 22)]
    at_500 = _bytes(settings, SHAPE, 500)
    assert _bytes(settings, SHAPE, 499) < at_500 < _bytes(settings, SHAPE, 501)
    longest = longest_completion(settings, SHAPE, _device(at_500))
    assert longest.completion_length == 500 and longest.plan.device_bytes == at_500 and not longest.at_least
    assert longest_completion(settings, SHAPE, _device(at_500 - 1)).completion_length == 499
    none = longest_completion(settings, SHAPE, _device(_bytes(settings, SHAPE, 1) - 1))
    assert none.completion_length == 0 and none.plan is None
    end = longest_completion(settings, SHAPE, _device(_bytes(settings, SHAPE, 1000)), high=800)
    assert end.completion_length == 800 and end.at_least


def test_the_search_crosses_the_replay_cap_where_the_plan_drops():
    """The fast rollout keeps the round's softmax (2 x T x 151,936 float32) up to REPLAY_MAX_BYTES = 1 GiB; with one
    micro-step a round it also keeps layer outputs (2 x 2 x (8 + T) x 896 float32): the softmax stops fitting at
    T = 873 (2 x 873 x 151,936 x 4 = 1,061 MB + outputs 12.6 MB > 1,073.7 MB), and the plan drops there. A budget
    a byte under the plan at T = 872 still trains past the cap: the answer is in the next segment, the planner's
    own boundary there."""
    settings = PROXY_SETTINGS
    assert _segments(settings, PROXY, 1 << 22)[0] == (1, 872)
    before, after = _bytes(settings, PROXY, 872), _bytes(settings, PROXY, 873)
    assert after < before - 400 * 2**20  # the softmax of the round (less the head's backward chunk) is gone
    longest = longest_completion(settings, PROXY, _device(before - 1))
    T = longest.completion_length
    assert T > 873 and _bytes(settings, PROXY, T) <= before - 1 < _bytes(settings, PROXY, T + 1)


def test_settings_that_reach_longer_are_the_planners_lengths_for_them():
    """Checkpointing off, 4 rows a micro-batch: checkpointing, one row a micro-batch (same global batch: 4 x the
    accumulation and the round's micro-steps), a 64-row head chunk, the tiles, the recomputed attention, all of
    them, and LoRA; each listed length is
    `longest_completion` of exactly those settings, every one longer than the run's own; bnpo lists no split."""
    settings = dataclasses.replace(PROXY_SETTINGS, micro_batch=4, checkpointing=False, rollout=rollout("generate"))
    device = _device(8 * 2**30)
    base = longest_completion(settings, PROXY, device).completion_length
    from peft import LoraConfig

    lora = model_shape(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    longer = longer_settings(settings, PROXY, device, split_exact=True, lora_shape=lora)
    by_changes = {tuple(sorted(f.changes)): f for f in longer}
    checkpointing = by_changes[("gradient_checkpointing",)]
    assert checkpointing.completion_length == longest_completion(
        dataclasses.replace(settings, checkpointing=True), PROXY, device).completion_length > base
    split = by_changes[("gradient_accumulation_steps", "per_device_train_batch_size", "steps_per_generation")]
    assert split.changes == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4,
                             "steps_per_generation": 4}
    assert split.completion_length == longest_completion(dataclasses.replace(
        settings, micro_batch=1, accumulation_steps=4, steps_per_generation=4), PROXY, device).completion_length
    together = max((f for f in longer if f.same_objective), key=lambda f: f.completion_length)
    assert together.changes == {"gradient_checkpointing": True, "per_device_train_batch_size": 1,
                                "gradient_accumulation_steps": 4, "steps_per_generation": 4, "mlp_tile_tokens": 1024,
                                "recompute_attention": True, "logprob_chunk_size": 64}
    together_settings = dataclasses.replace(settings, checkpointing=True, micro_batch=1, accumulation_steps=4,
                                            steps_per_generation=4)
    together_settings = together_settings.with_forward(mlp_tile_tokens=1024, recompute_attention=True, chunk_size=64)
    assert together.completion_length == longest_completion(together_settings, PROXY, device).completion_length
    assert together_settings.forward.chunk_size == 64
    assert all(f.completion_length > base for f in longer)
    assert [f.completion_length for f in longer] == sorted(f.completion_length for f in longer)
    with_lora = [f for f in longer if not f.same_objective]
    assert with_lora and all(f.changes["use_peft"] is True for f in with_lora)
    assert max(f.completion_length for f in with_lora) == longest_completion(
        together_settings, lora, device).completion_length
    unsplit = longer_settings(settings, PROXY, device, split_exact=False)
    assert not any("per_device_train_batch_size" in f.changes for f in unsplit)
