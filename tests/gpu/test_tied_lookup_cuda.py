"""On a CUDA GPU: a tied embedding's lookup adding its rows into the LM head's gradient (`modeling.tied_embedding`)
gives the dense lookup's gradients under bf16 autocast over float32 weights (the trainer's mixed precision), and the
backward's peak `max_memory_allocated` is lower by about the float32 V x E matrix. Skipped, with the reason,
without CUDA; on CPU the same is tested by the allocator's records (tests/modeling/test_tied_embedding.py).

    python -m pytest -q tests/gpu/test_tied_lookup_cuda.py
"""

from __future__ import annotations

import contextlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests need one", allow_module_level=True)

from grpo_trainer.modeling import forwards  # noqa: E402
from grpo_trainer.runtime import compat  # noqa: E402
from tests.helpers import model_of_kind  # noqa: E402

VOCAB = 32_768


def _grads_and_peak(model, ids, mask, T, dense: bool):
    model.zero_grad(set_to_none=True)
    forwards._VERDICTS.clear()
    with pytest.MonkeyPatch.context() as patch:
        if dense:  # the reference: the lookup's own dense backward
            patch.setattr(forwards, "tied_lookup", lambda lm: contextlib.nullcontext())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forwards.score(model, ids, mask, T, forwards.ForwardSettings(padding_free=True, chunk_size=16))
    loss = (out.logps * mask[:, -T:]).sum()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}, peak


def test_tied_gradient_equals_dense_and_the_backward_peak_drops(tokenizer):
    model = model_of_kind("qwen2.5-0.5b", tokenizer, vocab_size=VOCAB).cuda()
    compat.enable_checkpointing(model)
    model.train()
    T = 24
    ids = torch.randint(10, 90, (3, 6 + T), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    dense, dense_peak = _grads_and_peak(model, ids, mask, T, dense=True)
    grads, peak = _grads_and_peak(model, ids, mask, T, dense=False)
    assert grads.keys() == dense.keys() and "model.embed_tokens.weight" in grads
    for name in grads:  # bf16 products: the same sums in another order, within bf16 rounding of the products
        torch.testing.assert_close(grads[name], dense[name], atol=1e-4, rtol=1e-3, msg=name)
    matrix = model.get_input_embeddings().weight.numel() * 4  # 32,768 x 224 x 4 B = 29.4 MB
    assert dense_peak - peak > 0.8 * matrix, (dense_peak, peak, matrix)
