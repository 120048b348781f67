"""TRL's vLLM importance-sampling correction in training runs: its metrics under TRL's names in every mode, the
weight entering the loss (a mask that drops every token leaves the weights where they were), the off-policy
round reusing its sampling-time log-probs, and the correction switched off."""

from __future__ import annotations

import pytest
import torch

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.rewards.library import copy_digits_reward
from tests.vllm_integration.vllm_helpers import trainer_args, vllm_tiny_model

METRICS = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max"]


def _train(tmp_path, tokenizer, **overrides):
    trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward, args=trainer_args(tmp_path, **overrides),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = any(not torch.equal(start[n], p) for n, p in trainer.model.named_parameters())
    return trainer, [h for h in trainer.state.log_history if "loss" in h], moved


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_every_mode_logs_trls_metrics_and_trains(tmp_path, tokenizer, mode):
    trainer, steps, moved = _train(tmp_path, tokenizer, vllm_importance_sampling_mode=mode,
                                   vllm_importance_sampling_clip_min=0.5)
    assert moved
    for step in steps:
        assert all(name in step for name in METRICS), sorted(step)
        # float32 engine and trainer: weights within float error of 1, nothing clipped or masked
        low, high = step["sampling/importance_sampling_ratio/min"], step["sampling/importance_sampling_ratio/max"]
        assert 0.999 < low <= high < 1.001
        assert step["sampling/sampling_logp_difference/mean"] <= step["sampling/sampling_logp_difference/max"] < 1e-4


def test_the_weight_enters_the_loss(tmp_path, tokenizer):
    # token_mask with a band [2, 3] that excludes every weight (~1): every token's weight is 0, so with beta = 0 the
    # loss and its gradient are 0 and AdamW (no weight decay) leaves every parameter exactly where it was
    _, steps, moved = _train(tmp_path, tokenizer, vllm_importance_sampling_mode="token_mask",
                             vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=3.0)
    assert not moved
    assert all(s["sampling/importance_sampling_ratio/max"] == 0.0 and s["loss"] == 0.0 for s in steps)
    # the same masking per sequence
    _, _, moved = _train(tmp_path, tokenizer, vllm_importance_sampling_mode="sequence_mask",
                         vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=3.0)
    assert not moved


def test_an_off_policy_round_keeps_its_sampling_time_logps(tmp_path, tokenizer):
    # steps_per_generation 2 with no gradient accumulation: the round's second micro-batch runs after an optimizer
    # step, so its ratio needs the old log-probs, which the correction computed when the round was sampled
    calls = []
    trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward,
                          args=trainer_args(tmp_path, steps_per_generation=2, max_steps=2),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    forward = trainer.corrections.score
    trainer.corrections.score = lambda model, part: calls.append(part.rows) or forward(model, part)
    trainer.train()
    assert calls == [16]  # one forward over the whole round (2 x 8 rows), none per micro-batch
    assert all(part.old_logps is not None and part.token_weights is not None for part in trainer.buffer.parts)


def test_without_the_correction_no_forward_and_no_metrics(tmp_path, tokenizer):
    calls = []
    trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward,
                          args=trainer_args(tmp_path, vllm_importance_sampling_correction=False),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    forward = trainer.corrections.score
    trainer.corrections.score = lambda model, part: calls.append(part.rows) or forward(model, part)
    trainer.train()
    assert calls == []  # on-policy: no old log-probs to compute
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert steps and not any(name in step for step in steps for name in METRICS)
