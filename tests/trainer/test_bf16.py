"""bfloat16 on CPU: the bodies of tests/gpu/test_cuda_bf16.py (tests/gpu/bodies.py) on the CPU's bf16 kernels. The
fast decoder's greedy tokens are `generate`'s, the LM head's log-probs, entropies and the loss stay within bf16
rounding of float32's, and `bf16=True` (accelerate's CPU autocast, with `use_cpu=True`) trains every matrix."""

import pytest
import torch

from tests.gpu.bodies import (
    bf16_greedy_tokens_equal_generate,
    bf16_logprobs_within_rounding,
    short_bf16_run_moves_the_weights,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_fast_decoder_greedy_tokens_equal_generate_in_bf16(tokenizer, kind):
    bf16_greedy_tokens_equal_generate(tokenizer, kind, CPU)


def test_logprobs_and_loss_in_bf16_stay_within_rounding_of_fp32(tokenizer):
    bf16_logprobs_within_rounding(tokenizer, CPU)


def test_a_short_bf16_training_run_changes_the_weights(tokenizer, toy_dataset, tmp_path):
    short_bf16_run_moves_the_weights(tmp_path, tokenizer, toy_dataset, CPU)
