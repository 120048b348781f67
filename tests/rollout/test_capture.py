"""What a rollout keeps for the loss (`rollout.capture`): by the trainer's settings, within the memory budget."""

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from grpo_trainer.rollout import capture
from grpo_trainer.rollout.types import ReplayCapture, Rollout, SamplerRecord
from grpo_trainer.runtime import compat
from tests.helpers import checkpointing_trainer


def _replayed(round_, name):
    """The round's replay tensor `name` (`layer_outputs`, or `sampling_probs`: the softmax)."""
    return getattr(round_.sampler.replay, "probs" if name == "sampling_probs" else name)


@pytest.mark.parametrize(("overrides", "keeps"), [
    ({}, ("layer_outputs", "sampling_probs")),
    ({"num_iterations": 2}, ()),  # the second pass over the round runs after an optimizer step
    ({"generation_backend": "generate"}, ()),  # generate keeps none of them
    ({"gradient_checkpointing": False}, ("sampling_probs",)),  # no checkpointed forward to stand in for
    ({"temperature": 1.0, "generation_kwargs": {"temperature": 0.5}}, ("layer_outputs",)),  # not the loss's softmax
])
def test_the_rollout_keeps_what_can_be_replayed(tmp_path, tokenizer, toy_dataset, overrides, keeps):
    trainer = checkpointing_trainer(tmp_path, tokenizer, toy_dataset, **overrides)
    if overrides.get("gradient_checkpointing") is False:
        compat.disable_checkpointing(trainer.model)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    assert tuple(k for k in ("layer_outputs", "sampling_probs") if _replayed(round_, k) is not None) == keeps
    evaluation = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "eval")
    assert evaluation.sampler.replay.layer_outputs is None and evaluation.sampler.replay.probs is None


@pytest.mark.parametrize(("cap", "keeps"), [
    # 8 rows x 2 layers x (prompt + 8 new tokens) x 64 floats is over 8 x 2 x 8 x 64 x 4 bytes; the sampling
    # distributions, 8 rows x 8 tokens x V floats, fit that alone.
    (8 * 2 * 8 * 64 * 4, ("sampling_probs",)),
    (8 * 8 * 4, ()),  # under 8 x 8 x V floats: neither
])
def test_replay_tensors_over_the_memory_cap_are_not_kept(tmp_path, tokenizer, toy_dataset, monkeypatch, cap, keeps):
    trainer = checkpointing_trainer(tmp_path, tokenizer, toy_dataset)
    monkeypatch.setattr(capture, "REPLAY_MAX_BYTES", cap)
    round_ = trainer._generate_and_score([toy_dataset[i // 4] for i in range(8)], "train")
    assert tuple(k for k in ("layer_outputs", "sampling_probs") if _replayed(round_, k) is not None) == keeps


@pytest.mark.parametrize(("training", "on_policy", "plain", "checkpointing", "expected"), [
    (True, True, True, True, (True, True)),
    (True, True, False, True, (False, True)),  # DDP/DeepSpeed/FSDP hook the forward: no layer replay
    (True, True, True, False, (False, True)),  # no checkpointed forward to stand in for
    (True, False, True, True, (False, False)),  # weights change before the round's last micro-step
    (False, True, True, True, (False, False)),  # evaluation has no backward
])
def test_plan_keeps_replay_tensors_only_where_they_can_stand_in(training, on_policy, plain, checkpointing,
                                                                 expected):
    plan = capture.plan(training=training, on_policy=on_policy, plain_single_process=plain,
                        checkpointing=checkpointing)
    assert (plan.layer_outputs, plan.probs) == expected
    assert plan.max_bytes == capture.REPLAY_MAX_BYTES


def test_replay_buffers_fill_the_budget_layer_outputs_first():
    # rows 2, layers 3, prompt 4 + 5 new tokens, width 8: outputs 2 * 3 * 9 * 8 = 432 floats = 1728 bytes;
    # softmax 2 * 5 * V=10 floats = 100 floats = 400 bytes.
    shapes = {"rows": 2, "prompt_length": 4, "max_new_tokens": 5, "layers": 3, "hidden_size": 8, "vocab_size": 10,
              "dtype": torch.float32, "device": torch.device("cpu")}
    both = capture.Capture(layer_outputs=True, probs=True, max_bytes=1728 + 400)
    outputs, probs = capture.replay_buffers(both, **shapes)
    assert outputs.shape == (2, 3, 9, 8) and not outputs.any() and probs.shape == (2, 5, 10)
    one_short = capture.Capture(layer_outputs=True, probs=True, max_bytes=1728 + 399)
    outputs, probs = capture.replay_buffers(one_short, **shapes)
    assert outputs is not None and probs is None  # layer outputs first, then nothing else fits
    only_probs = capture.Capture(layer_outputs=True, probs=True, max_bytes=1727)
    outputs, probs = capture.replay_buffers(only_probs, **shapes)
    assert outputs is None and probs.shape == (2, 5, 10)
    assert capture.replay_buffers(capture.Capture(), **shapes) == (None, None)  # nothing asked for


@pytest.mark.parametrize("new_tokens, keeps_probs", [(64, True), (256, False), (1024, False)])
def test_no_full_vocabulary_softmax_is_kept_past_the_budget_at_qwen_shapes(new_tokens, keeps_probs):
    """Qwen2.5-0.5B (24 layers, width 896, V = 151,936), 8 rows, a 64-token prompt, the default 1 GiB budget
    (2**30 = 1,073,741,824 bytes). Layer outputs: 8 * 24 * (64 + T) * 896 * 4 bytes = 88,080,384 at T = 64,
    220,200,960 at 256, 748,683,264 at 1024: always kept. Softmax: 8 * T * 151,936 * 4 bytes = 311,164,928 at 64
    (sum 399,245,312: fits), 1,244,659,712 at 256 and 4,978,638,848 at 1024: not kept (the loss recomputes the
    logits in 128 MiB chunks instead). On the meta device: nothing is allocated."""
    shapes = {"rows": 8, "prompt_length": 64, "max_new_tokens": new_tokens, "layers": 24, "hidden_size": 896,
              "vocab_size": 151936, "dtype": torch.float32, "device": torch.device("meta")}
    outputs, probs = capture.replay_buffers(capture.Capture(layer_outputs=True, probs=True), **shapes)
    assert outputs.shape == (8, 24, 64 + new_tokens, 896)
    assert (probs is not None) == keeps_probs


def _with_sampler_values() -> Rollout:
    """A rollout of 2 rows x 3 tokens (all ones) carrying every sampler tensor."""
    ones = torch.ones(2, 3)
    return Rollout(ones.long(), ones.long(), ones.long(), ones.long(), torch.zeros(2, dtype=torch.bool),
                   SamplerRecord("decoder", logps=ones, entropy=ones, exact=True,
                                 replay=ReplayCapture(ones[..., None], ones[:, None, :, None])))


def test_a_rollout_with_tool_tokens_keeps_no_sampler_tensor():
    # Tool tokens were never sampled: no value of the sampler may stand in for them (capture, decision 4).
    out = _with_sampler_values()
    assert capture.drop_for_tool_results(out) is out  # every token sampled: all of it stays
    with_tools = capture.drop_for_tool_results(dataclasses.replace(out, env_mask=torch.tensor([[1, 0, 1], [1, 1, 1]])))
    assert (with_tools.sampler.logps, with_tools.sampler.entropy, with_tools.sampler.replay.probs,
            with_tools.sampler.replay.layer_outputs) == (None, None, None, None)
    assert torch.equal(with_tools.env_mask, torch.tensor([[1, 0, 1], [1, 1, 1]]))


def test_sampling_values_are_dropped_where_they_are_not_the_losss_distribution():
    out = _with_sampler_values()
    sampled = GenerationConfig(do_sample=True, temperature=0.7)
    assert capture.drop_unusable(out, sampled, 0.7) is out
    for config, temperature in ((sampled, 1.0), (GenerationConfig(do_sample=False), 0.7)):
        kept = capture.drop_unusable(out, config, temperature)
        assert kept.sampler.logps is None and kept.sampler.entropy is None and kept.sampler.replay.probs is None
        # hidden states do not depend on the temperature
        assert kept.sampler.replay.layer_outputs is out.sampler.replay.layer_outputs
