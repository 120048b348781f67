"""On a CUDA GPU: a tied embedding's lookup adding its rows into the LM head's gradient (`modeling.tied_embedding`)
gives the dense lookup's gradients under bf16 autocast over float32 weights (the trainer's mixed precision), and the
backward's peak `max_memory_allocated` is lower by about the float32 V x E matrix. The module imports and collects
everywhere; without a CUDA device each test is skipped, with the reason (the `gpu` marker, tests/conftest.py). The
gradients' body is tests/gpu/bodies.py's, which tests/modeling/test_tied_embedding.py runs on CPU under CPU bf16
autocast; there the peak is tested by the allocator's records, in float32.

    python -m pytest -q tests/gpu/test_tied_lookup_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.bodies import tied_gradients_equal_dense

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)

CUDA = torch.device("cuda:0")
VOCAB = 32_768


def _backward_peak(loss: torch.Tensor) -> int:
    """`torch.cuda.max_memory_allocated` during `loss.backward()`, above the bytes allocated when it started."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def test_tied_gradient_equals_dense_and_the_backward_peak_drops(tokenizer):
    run = tied_gradients_equal_dense(tokenizer, CUDA, VOCAB, backward=_backward_peak)
    matrix = run.model.get_input_embeddings().weight.numel() * 4  # 32,768 x 224 x 4 B = 29.4 MB
    assert run.dense_measured - run.measured > 0.8 * matrix, (run.dense_measured, run.measured, matrix)
