"""On a CUDA GPU, in bfloat16 (where users train): the fast decoder samples what `model.generate` samples, the
LM-head log-probs and the loss stay within bfloat16's rounding of their float32 values, and a short training run
changes the weights. The module imports and collects everywhere; without a CUDA device each test is skipped, with
the reason (the `gpu` marker, tests/conftest.py). The bodies are tests/gpu/bodies.py's, which
tests/trainer/test_bf16.py runs on CPU in bfloat16 too.

    python -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.generate import generate_rollout
from tests.gpu.bodies import (
    bf16_greedy_tokens_equal_generate,
    bf16_logprobs_within_rounding,
    short_bf16_run_moves_the_weights,
)
from tests.helpers import assert_same_rollout, greedy_config, grouped_prompts, model_of_kind

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)

CUDA = torch.device("cuda:0")


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_fast_decoder_greedy_tokens_equal_generate_in_bf16(tokenizer, kind):
    bf16_greedy_tokens_equal_generate(tokenizer, kind, CUDA)


def test_logprobs_and_loss_in_bf16_stay_within_rounding_of_fp32(tokenizer):
    bf16_logprobs_within_rounding(tokenizer, CUDA)


def test_a_short_bf16_training_run_changes_the_weights(tokenizer, toy_dataset, tmp_path):
    short_bf16_run_moves_the_weights(tmp_path, tokenizer, toy_dataset, CUDA)


def test_the_fast_backend_samples_with_generate_on_cuda_by_default(tokenizer, caplog):
    """`rollout.fast.backend` decision 5: by measurement, `generate` on CUDA unless the decoder is asked for."""
    model = model_of_kind("qwen2", tokenizer).to(device=CUDA, dtype=torch.bfloat16).eval()
    prompts, config = grouped_prompts(tokenizer).to(CUDA), greedy_config(tokenizer)
    with torch.no_grad(), caplog.at_level("INFO", logger="grpo_trainer.rollout.fast.backend"):
        default = FastBackend().generate(model, prompts, config)
        reference = generate_rollout(model, prompts, config)
    assert "measured faster than the decoder" in caplog.text
    assert_same_rollout(default, reference)
    assert default.sampler.logps is None  # generate keeps no sampler values
