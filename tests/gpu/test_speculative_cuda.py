"""On a CUDA GPU: speculative rollouts (`rollout.speculative`) through the eager decoder, which asking for drafts
selects on CUDA. Greedy completions equal the plain decoder's in float32; sampled, the committed tokens' log-probs
equal the model's own forward in float32 and within bfloat16 rounding. The module imports and collects everywhere;
without a CUDA device each test is skipped, with the reason (the `gpu` marker, tests/conftest.py). The bodies are
tests/gpu/bodies.py's, which tests/rollout/speculative/test_speculative_loop.py runs on CPU.

    python -m pytest -q tests/gpu/test_speculative_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.bodies import speculative_greedy_equals_plain, speculative_logps_equal_a_forward

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)

CUDA = torch.device("cuda:0")


@pytest.mark.parametrize("kind", ["qwen2.5-0.5b", "llama", "qwen3"])
def test_greedy_with_drafts_equals_the_plain_decoder(tokenizer, kind):
    speculative_greedy_equals_plain(tokenizer, kind, CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logps_equal_the_models_forward(tokenizer, dtype):
    speculative_logps_equal_a_forward(tokenizer, dtype, CUDA)
