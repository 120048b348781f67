"""The planner under sequence parallelism (`sequence_parallel`, parallelism_config's sp_size), by hand on the small
shape: E 64, I 128, 4 / 2 heads of 16, 2 layers, float32, 4 rows of 6 + 10 = 16 tokens, checkpointing.

ALST's loop (trainer/sequence_group.py) runs each log-prob forward over one process's rows at `ceil(N / sp)` of their
positions, unmasked (Ulysses attention), and the policy forward recomputes what the rollout's values would stand in
for on-policy. Rounds and generation keep every position."""

import dataclasses

import pytest

from grpo_trainer.planning import estimate, plan_memory
from tests.planning.shapes import SETTINGS, SHAPE

F = estimate.INSTANTS.index("loss forward")
S = estimate.INSTANTS.index("scoring")


def _items(settings):
    return {item.name: item for item in plan_memory(settings, SHAPE).items}


@pytest.mark.parametrize("sp, tokens", [(1, 16), (2, 8), (3, 6)])
def test_the_loss_forward_saves_a_slice_of_each_row(sp, tokens):
    """Each layer's input and the embedding's and final norm's outputs, `[4, tokens, 64]` float32: 4 x tokens x 256
    B each, 4 of them: 65,536 / 32,768 / 24,576 B at sp 1 / 2 / 3 (16 tokens; 8; ceil(16 / 3) = 6)."""
    settings = dataclasses.replace(SETTINGS, sequence_parallel=sp)
    assert settings.forward_length == tokens and settings.sequence_length == 16
    assert _items(settings)["activations"].bytes[F] == 4 * (4 * tokens * 64 * 4) == {1: 65_536, 2: 32_768,
                                                                                       3: 24_576}[sp]


def test_the_scoring_forward_holds_a_slice():
    """A no-grad layer: 4 B x (rows x tokens x (4 E + 3 H D) + rows x tokens x 3 I) = 4 x (4 x 16 x 448 + 64 x 384)
    = 212,992 B at 16 tokens; at 8, half: 4 x (14,336 + 12,288) = 106,496 B."""
    beta = dataclasses.replace(SETTINGS, beta=0.04)
    assert _items(beta)["scoring forward"].bytes[S] == 212_992
    assert _items(dataclasses.replace(beta, sequence_parallel=2))["scoring forward"].bytes[S] == 106_496


def test_the_recomputed_layer_holds_a_slice_without_a_mask():
    """Rows of 6 + 250 = 256 tokens: the recomputed layer saves 4,624 B per token (`activation_bytes_per_token`)
    less its input (64 x 4 B, kept by the checkpoint and counted there), plus its MLP backward's intermediate
    gradient (128 x 4 B), and, padded, each row's [256, 256] float32 mask: 4 x (256 x 4,880 + 4 x 65,536) =
    6,045,696 B. With sp = 2: 128 tokens and no mask (Ulysses runs unmasked), 4 x 128 x 4,880 = 2,498,560 B, less
    than half."""
    long = dataclasses.replace(SETTINGS, completion_length=250)
    assert estimate.activation_bytes_per_token(long, SHAPE) == 4_624
    assert max(_items(long)["layer recomputation"].bytes) == 6_045_696
    # (at the backward's end here: at its start the round's kept softmax, read by the head's backward, is larger)
    assert max(_items(dataclasses.replace(long, sequence_parallel=2))["layer recomputation"].bytes) == 2_498_560


def test_the_rollout_values_do_not_stand_in_for_the_sharded_forward():
    """On-policy, with the rollout's log-probs at the loss's temperature, the unsharded loss forward projects no
    LM-head chunk (the values stand in); the sharded one recomputes them: 40 rows x V 1,000 x 4 B x 2 (logits and
    their softmax) = 320,000 B at the loss forward. Rounds and generation keep all 16 positions."""
    plain, sharded = _items(SETTINGS), _items(dataclasses.replace(SETTINGS, sequence_parallel=2))
    assert "log-prob chunks" not in plain and sharded["log-prob chunks"].bytes[F] == 320_000
    for name in ("round tensors", "KV cache"):
        assert plain[name].bytes == sharded[name].bytes


def test_the_trainer_plans_with_the_config_s_sp_size(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    from grpo_trainer import GRPOConfig
    from grpo_trainer.trainer.memory import plan_settings

    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=2, report_to="none",
                      use_cpu=True, padding_free=False, parallelism_config=ParallelismConfig(sp_size=2))
    assert plan_settings(args, prompt_length=6).sequence_parallel == 2
    args.parallelism_config = None
    assert plan_settings(args, prompt_length=6).sequence_parallel == 1
