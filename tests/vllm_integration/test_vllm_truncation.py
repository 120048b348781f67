"""vLLM sampling with top_k, real engine: its log-probs are the processed ones (over the kept support), so with
`keep_sampling_mask` (the trainer recomputes the supports from its own logits in the correction's forward) the
importance weights are 1, and without it they are the kept mass, which the mismatch report names."""

from __future__ import annotations

import math

import pytest

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.rewards.library import copy_digits_reward
from tests.vllm_integration.vllm_helpers import trainer_args, vllm_tiny_model


def _steps(tmp_path, tokenizer, **overrides):
    trainer = GRPOTrainer(vllm_tiny_model(tokenizer), copy_digits_reward,
                          args=trainer_args(tmp_path, top_k=5, vllm_importance_sampling_mode="token_truncate",
                                            vllm_importance_sampling_clip_max=100.0, **overrides),
                          train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_with_the_mask_the_weights_are_one(tmp_path, tokenizer):
    for step in _steps(tmp_path, tokenizer):
        low, high = step["sampling/importance_sampling_ratio/min"], step["sampling/importance_sampling_ratio/max"]
        assert 0.999 < low <= high < 1.001
        assert step["sampling/sampling_logp_difference/mean"] < 1e-4
        assert step["sampling/log_kept_mass/mean"] < -0.05  # top_k 5 of 104 tokens did cut mass


def test_without_the_mask_the_weights_are_the_kept_mass_and_the_report_says_so(tmp_path, tokenizer, caplog):
    with caplog.at_level("WARNING", logger="grpo_trainer.trainer.grpo_trainer"):
        steps = _steps(tmp_path, tokenizer, keep_sampling_mask=False, sampling_mismatch_threshold=0.01)
    for step in steps:
        # |log pi_trainer - log pi_vllm| = -log p(kept) on every token
        assert step["sampling/sampling_logp_difference/mean"] == pytest.approx(-step["sampling/log_kept_mass/mean"],
                                                                              rel=1e-3)
        assert step["sampling/importance_sampling_ratio/max"] <= 1.0 + 1e-6
        assert step["sampling/importance_sampling_ratio/mean"] < math.exp(-0.05)
    assert "Likely cause: truncated support" in caplog.text
