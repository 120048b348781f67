"""The plan's terms for rounds held ahead (`async_rollouts`), resampled rounds (`zero_variance_groups='resample'`) and
the packed layout (`padding_free`), by hand (`planning.estimate` decisions 5-7), and how a config reaches them."""

import dataclasses

import pytest

from grpo_trainer.planning import plan_memory
from grpo_trainer.planning.estimate import INSTANTS, packed_mask_elements, round_bytes
from grpo_trainer.planning.report import format_plan
from grpo_trainer.planning.settings import RoundsHeld
from tests.planning.shapes import SETTINGS, SHAPE, rollout

# SETTINGS: 4 rows per round, N = 6 + 10 = 16 tokens, T = 10. One round's tensors:
# ids and masks 4 x 16 x 8 B x 2 = 1,024; six float32 [B, T] columns 4 x 10 x 4 B x 6 = 960; 1,984 bytes.
ROUND = 1_984
AHEAD_1, AHEAD_2 = (RoundsHeld(ahead=k, sampling_overlaps_step=True) for k in (1, 2))  # async_rollouts=1, 2
GENERATE = dataclasses.replace(SETTINGS, rollout=rollout("generate"))  # no replay tensors: sums stay by hand


def item(plan, name):
    found = [i for i in plan.items if i.name == name]
    return dict(zip(INSTANTS, found[0].bytes, strict=True)) if found else None


def test_a_round_by_hand():
    assert round_bytes(SETTINGS, SHAPE) == 4 * 16 * 8 * 2 + 4 * 10 * 4 * 6 == ROUND


def test_rounds_held_ahead_wait_through_every_instant():
    ahead = dataclasses.replace(GENERATE, rounds=AHEAD_2)
    held = item(plan_memory(ahead, SHAPE), "rounds held ahead")
    assert held == dict.fromkeys(INSTANTS, 2 * ROUND)  # async_rollouts=2: two rounds of 1,984 bytes
    assert item(plan_memory(GENERATE, SHAPE), "rounds held ahead") is None


def test_an_in_process_sampler_overlaps_the_training_instants_but_not_the_optimizer_step():
    """The producer's job reads the live weights (no snapshot), so only the optimizer step waits for it: the KV
    cache is held at the loss instants too. generate's cache: 4 rows x 16 tokens x 2 layers x (K 2 x D 16) x 2
    (keys, values) x 4 B = 32,768, plus one layer's old copy while it grows (/ 2 layers) = 49,152."""
    kv = 4 * 16 * 2 * 2 * 16 * 2 * 4
    kv += kv // 2
    assert item(plan_memory(GENERATE, SHAPE), "KV cache") == {**dict.fromkeys(INSTANTS, 0), "rollout": kv}
    ahead = item(plan_memory(dataclasses.replace(GENERATE, rounds=AHEAD_1), SHAPE), "KV cache")
    assert ahead == {**dict.fromkeys(INSTANTS, kv), "optimizer step": 0}
    # an engine elsewhere holds nothing here, ahead or not
    remote = dataclasses.replace(GENERATE, rounds=AHEAD_1, rollout=dataclasses.replace(GENERATE.rollout,
                                                                                      cache="remote"))
    assert item(plan_memory(remote, SHAPE), "KV cache") is None


def test_rounds_sampled_ahead_are_off_policy_so_replay_is_not_kept_and_scoring_occurs():
    on = plan_memory(SETTINGS, SHAPE)  # the fast decoder on CPU, on-policy: replay tensors, no scoring instant
    assert item(on, "replay tensors") is not None and not on.occurs[INSTANTS.index("scoring")]
    ahead = plan_memory(dataclasses.replace(SETTINGS, rounds=AHEAD_1), SHAPE)
    assert item(ahead, "replay tensors") is None and ahead.occurs[INSTANTS.index("scoring")]


def test_resampled_rounds_are_held_while_the_last_is_sampled():
    resample = dataclasses.replace(GENERATE, resample_rounds=3)
    held = item(plan_memory(resample, SHAPE), "resampled rounds")
    assert held == {**dict.fromkeys(INSTANTS, 0), "rollout": 3 * ROUND}  # max_resample_rounds=3 x 1,984 bytes
    # with replay tensors each extra round keeps its own: the fast decoder's 32,768 B of layer outputs and
    # 160,000 B of softmax (tests/planning/test_estimate.py::test_rollout_items) on top of the round
    fast = item(plan_memory(dataclasses.replace(SETTINGS, resample_rounds=1), SHAPE), "resampled rounds")
    replay = item(plan_memory(SETTINGS, SHAPE), "replay tensors")["rollout"]
    assert fast["rollout"] == ROUND + replay
    assert item(plan_memory(GENERATE, SHAPE), "resampled rounds") is None


def test_packed_mask_elements_by_hand():
    """c = P_layer / (2 H D) = 40,000 / (2 x 4 x 16) = 312 (floor); K = B N (N + c) = 4 x 16 x (16 + 312) = 20,992.
    The packer's layout costs no more than one sequence per row: c x + e <= K with x = R W, and e = x W <= x^2.
    x = 56: 56^2 + 312 x 56 = 3,136 + 17,472 = 20,608 <= K, so e can reach 3,136; x = 57: 3,249 + 17,784 = 21,033
    > K, so e <= K - 312 x 57 = 20,992 - 17,784 = 3,208 < 57^2; larger x only lowers K - c x. The bound is 3,208."""
    assert packed_mask_elements(SETTINGS, SHAPE) == 3_208


def test_the_packed_mask_bound_holds_for_the_packers_own_layouts():
    """Over many length mixes, the layout `modeling.packing.plan` chooses under the cost `packed_mask_elements`
    assumes has at most that many mask elements, and the bound is near what some mix reaches."""
    import random

    from grpo_trainer.modeling.packing import PackingCost, PackingSettings, plan

    for B, N, c in ((2, 8_201, 8_300), (4, 16, 312), (8, 1_000, 200), (3, 500, 5_000)):
        settings = dataclasses.replace(SETTINGS, micro_batch=B, prompt_length=1, completion_length=N - 1)
        shape = dataclasses.replace(SHAPE, layer_parameters=c * 2 * SHAPE.heads * SHAPE.head_dim)
        bound = packed_mask_elements(settings, shape)
        packing = PackingSettings(cost=PackingCost(token=float(c), pair=1.0))
        rng = random.Random(0)
        reached = 0
        for _ in range(300):
            lengths = [N] + [rng.randint(1, N) for _ in range(B - 1)]
            rows, width = plan(lengths, packing)
            reached = max(reached, len(rows) * width ** 2)
        assert B * N * N <= reached <= bound  # every sequence full: one per row
        assert reached > 0.8 * bound, (B, N, c, reached, bound)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_packed_forward_with_dense_masks(checkpointing):
    """A bool mask of 3,208 elements (1 B) per forward, and SDPA's float32 bias (4 B) per layer call: kept for the
    backward by one layer with checkpointing, by both of the 2 layers without."""
    packed = dataclasses.replace(SETTINGS, checkpointing=checkpointing).with_forward(padding_free=True)
    mask, bias = 3_208, 3_208 * 4
    kept = 1 if checkpointing else 2
    assert item(plan_memory(packed, SHAPE), "packed attention mask") == {
        "rollout": 0, "scoring": mask + bias, "loss forward": mask + kept * bias, "backward start": mask + kept * bias,
        "backward end": mask + bias, "optimizer step": 0}
    padded = plan_memory(packed.with_forward(padding_free=False), SHAPE)
    assert item(padded, "packed attention mask") is None
    varlen = plan_memory(dataclasses.replace(packed, varlen_attention=True), SHAPE)  # flash-attention: no mask
    assert item(varlen, "packed attention mask") is None
    # one row per micro-batch: a row never holds two sequences, so the packed forward runs causal, unmasked
    alone = plan_memory(dataclasses.replace(packed, micro_batch=1, accumulation_steps=4), SHAPE)
    assert item(alone, "packed attention mask") is None
    # ZeRO-3 and FSDP score padded by rule: their padded masks are in the layers (as padding_free=False), not here
    for sharded in ({"zero_stage": 3}, {"fsdp": True}):
        two = dataclasses.replace(packed, processes=2, processes_per_node=2, **sharded)
        assert item(plan_memory(two, SHAPE), "packed attention mask") is None
        assert plan_memory(two, SHAPE).totals() == plan_memory(two.with_forward(padding_free=False), SHAPE).totals()
    assert plan_memory(packed, SHAPE).peak_bytes > padded.peak_bytes


def test_the_config_reaches_the_new_terms(tmp_path):
    from grpo_trainer import GRPOConfig
    from grpo_trainer.trainer import memory

    def settings(**kwargs):
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)
        return memory.plan_settings(args, prompt_length=8)

    default = settings()
    assert (default.rounds, default.forward.padding_free, default.varlen_attention, default.resample_rounds) == \
        (RoundsHeld(), True, False, 0)  # padding_free is on by default, under SDPA
    assert settings(async_rollouts=2).rounds == AHEAD_2
    assert not settings(padding_free=False).forward.padding_free
    assert settings(zero_variance_groups="resample", max_resample_rounds=3).resample_rounds == 3
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert memory.plan_settings(args, prompt_length=8, attention="flash_attention_2").varlen_attention


def test_the_printed_plan_names_them():
    # (config.checks refuses resampling with rounds sampled ahead: two runs)
    ahead = dataclasses.replace(GENERATE, rounds=AHEAD_2).with_forward(padding_free=True)
    text = format_plan(plan_memory(ahead, SHAPE)) \
        + format_plan(plan_memory(dataclasses.replace(GENERATE, resample_rounds=3), SHAPE))
    for words in ("rounds held ahead", "resampled rounds", "packed attention mask", "2 round(s) sampled ahead",
                  "packed (dense masks)", "up to 3 resampled round(s)", "rollout: in the process (a growing cache)"):
        assert words in text


def test_the_planner_names_no_backend():
    """It reads the backend's `MemoryProfile` (`rollout.backend.memory_profile`), the runtime's own choice."""
    from pathlib import Path

    from grpo_trainer import planning
    from grpo_trainer.rollout.backend import BACKENDS

    names = [*BACKENDS, "vllm_colocate", "vllm_server", "continuous"]
    for path in Path(planning.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not [n for n in names if f'"{n}"' in text or f"'{n}'" in text], path


def test_the_scoring_instant_follows_the_off_policy_owners_forwards(tmp_path):
    """The scoring instant occurs wherever `trainer.off_policy` runs a no-grad forward at the sampling weights: a
    vLLM server's rounds under the default importance-sampling correction (the item the planner used to miss), the
    mismatch report's own forward, asynchronous 'recompute'; not on-policy without them."""
    from grpo_trainer import GRPOConfig
    from grpo_trainer.planning.estimate import INSTANTS
    from grpo_trainer.trainer import memory

    scoring = INSTANTS.index("scoring")

    def occurs(**kwargs) -> bool:
        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)
        return plan_memory(memory.plan_settings(args, prompt_length=8), SHAPE).occurs[scoring]

    server = {"use_vllm": True, "vllm_mode": "server"}
    assert occurs(**server)
    assert not occurs(**server, vllm_importance_sampling_correction=False)
    assert not occurs(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_correction=False)
    assert not occurs() and occurs(sampling_mismatch_report=True)
    assert occurs(async_rollouts=1, async_correction="recompute")
