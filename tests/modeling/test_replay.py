"""Replay: the rollout's layer outputs and softmax stand in for the checkpointed loss forward's first pass and the LM
head's recomputed logits, giving the plain gradients, and a real run replays every step."""

import contextlib
import dataclasses
import math

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.modeling import replay
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rollout.types import ReplayCapture
from grpo_trainer.runtime import compat
from tests.helpers import (
    TWO_GROUPS_OF_4,
    checkpointing_trainer,
    fast_rollout,
    greedy_config,
    grouped_prompts,
    make_trainer,
    model_of_kind,
)


def _count_layer_runs(model, monkeypatch) -> list[int]:
    """Counts calls of every decoder layer's MLP: one per layer per forward or backward recompute."""
    runs = [0]
    for layer in model.get_decoder().layers:
        original = layer.mlp.forward

        def counted(*args, _original=original, **kwargs):
            runs[0] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(layer.mlp, "forward", counted)
    return runs


@pytest.mark.parametrize("kind", ["qwen2", "llama", "lora", "qwen2.5-0.5b"])
def test_replayed_layer_outputs_give_the_checkpointed_forwards_gradients(tokenizer, kind, monkeypatch):
    """The rollout's layer outputs stand in for the checkpointed forward's first pass: the loss's gradients are
    those of the plain checkpointed forward (prompts of three lengths, so left padding differs per row; sampled
    completions that end at different lengths), and each layer runs once (the backward's recompute), not twice.
    `qwen2.5-0.5b`: a real checkpoint's layout (grouped-query attention 14:2, tied embeddings)."""
    model = model_of_kind("qwen2" if kind == "lora" else kind, tokenizer)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)  # the adapter's random initialisation, fixed (not what earlier tests left the RNG at)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 init_lora_weights=False))
        model.enable_input_require_grads()
    lm = model.get_base_model() if kind == "lora" else model
    compat.enable_checkpointing(lm)
    model.train()
    checkpoints = [layer._gradient_checkpointing_func for layer in lm.get_decoder().layers]
    prompts = grouped_prompts(tokenizer)
    ids, mask = prompts.ids, prompts.mask
    torch.manual_seed(7 if kind == "qwen2.5-0.5b" else 3)  # seeds whose sampled rows end at different lengths
    rollout = fast_rollout(model, prompts, greedy_config(tokenizer, do_sample=True, max_new_tokens=10),
                           layer_outputs=True)
    B, T = rollout.completion_ids.shape
    assert rollout.sampler.replay.layer_outputs.shape == (B, len(lm.get_decoder().layers), prompts.ids.shape[1] + T,
                                           lm.config.hidden_size)
    assert 1 < int(rollout.completion_mask.sum(1).min()) < T  # rows end at different lengths
    weights = torch.randn(B, T) * rollout.completion_mask  # any loss that reads only completion tokens
    input_ids = torch.cat([ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([mask, rollout.completion_mask], 1)
    runs = _count_layer_runs(lm, monkeypatch)

    def grads(replayed: bool):
        model.zero_grad()
        runs[0] = 0
        context = replay.replayed_layers(lm.get_decoder().layers, rollout.sampler.replay.layer_outputs) if replayed \
            else contextlib.nullcontext()
        with context:
            logps = completion_logprobs(model, input_ids, attention_mask, T, known_logps=rollout.sampler.logps).logps
        (logps * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, runs[0]

    plain, plain_runs = grads(False)
    replayed, replayed_runs = grads(True)
    layers = len(lm.get_decoder().layers)
    assert (plain_runs, replayed_runs) == (2 * layers, layers)
    assert [layer._gradient_checkpointing_func for layer in lm.get_decoder().layers] == checkpoints  # restored
    assert plain.keys() == replayed.keys() and any("lora" in n for n in plain) == (kind == "lora")
    for name in plain:
        torch.testing.assert_close(replayed[name], plain[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["tiny", "qwen2.5-0.5b"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trainer_micro_batches_replay_their_rows_and_columns_with_the_plain_gradients(tmp_path, tokenizer,
                                                                                      toy_dataset, beta, kind,
                                                                                      monkeypatch):
    """A round cut into micro-batches of rows with different prompt and completion lengths: each micro-batch's
    slice of the layer outputs and of the sampling distributions (rows, then `Round.trimmed`'s columns) gives the
    loss and gradients of the plain forward; also on a real checkpoint's layout, whose tied head's gradient
    reaches the embedding through the replayed softmax."""
    # padding_free=False: layer runs are counted per forward (packing's replay: tests/modeling/test_forwards.py).
    model = None if kind == "tiny" else model_of_kind(kind, tokenizer)  # both: 2 layers
    trainer = checkpointing_trainer(tmp_path, tokenizer, toy_dataset, model=model, beta=beta,
                                    gradient_accumulation_steps=2, per_device_train_batch_size=4, padding_free=False)
    batch = [toy_dataset[i // 4] for i in range(8)]
    batch[4:] = [{**toy_dataset[0], "prompt": "c 1:"}] * 4  # a shorter prompt: its micro-batch trims left columns
    torch.manual_seed(0)
    round_ = trainer._generate_and_score(batch, "train")
    T = round_.completion_ids.shape[1]
    replayed = round_.sampler.replay
    assert replayed.layer_outputs.shape[:2] == (8, 2) and replayed.probs.shape == (8, T, len(tokenizer))
    model = trainer.model

    def loss_and_grads(inputs):
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    runs = _count_layer_runs(model, monkeypatch)
    for rows in (slice(0, 4), slice(4, 8), torch.tensor([1, 6, 2, 5])):
        assert (round_.select(rows).kept_columns()[0] > 0) == (rows == slice(4, 8))
        inputs = trainer.scorer.prepare(round_.select(rows), "train", trainer.model)
        runs[0] = 0
        replayed = loss_and_grads(inputs)
        assert runs[0] == 2  # 2 layers, each run once (the backward's recompute)
        plain = loss_and_grads(dataclasses.replace(inputs, sampler=dataclasses.replace(inputs.sampler,
                                                                                       replay=ReplayCapture())))
        torch.testing.assert_close(replayed[0], plain[0], atol=1e-6, rtol=0)
        for got, want in zip(replayed[1], plain[1]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_training_replays_the_rollout_and_learns(tmp_path, tokenizer, toy_dataset, monkeypatch):
    """A real run with the defaults (activation checkpointing on, on-policy): every loss forward replays."""
    calls = []
    original = replay.replayed_layers
    monkeypatch.setattr(replay, "replayed_layers", lambda *a: calls.append(a[1].shape) or original(*a))
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=make_tiny_model(tokenizer, seed=2),
                           **TWO_GROUPS_OF_4, max_completion_length=8, learning_rate=1e-2, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    # One per step; rows of zero advantage are skipped (beta 0), so up to 8 rows x 2 layers.
    assert len(calls) == 3 and all(shape[0] <= 8 and shape[1] == 2 for shape in calls)
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
