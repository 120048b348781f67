"""Float32 CPU matrix products through oneDNN where that library is the faster one: the fast decoder's
projections and LM head, the LM-head log-probs and their backward, and (`fast_linears`) every large `nn.Linear` of a
model while it trains.

PyTorch sends float32 CPU matmuls to the BLAS it was built with (MKL on x86 builds). MKL chooses its kernels by CPU
vendor, so on some CPUs (AMD processors with AVX-512, for one) its `sgemm` runs kernels that reach about half of
what the oneDNN kernels shipped in the same PyTorch build reach (`torch.ops.mkldnn._linear_pointwise`, the kernel
inductor emits for CPU linears). Both compute the same float32 products; only the order of the sums differs, so
results agree to float rounding, as two BLAS libraries do.

Decisions:

1. Measured, not assumed: the first call times one product with each library (`onednn_preferred`) and oneDNN is
   used only if it was clearly faster on this machine. `GRPO_TRAINER_ONEDNN=0` / `=1` forces the choice.
2. Only products of at least `MIN_MACS` multiply-adds go to oneDNN: below that its fixed cost per call exceeds what
   its kernels save. Other dtypes, other devices and autocast keep PyTorch's own path.
3. `fast_linears(*models)` replaces, for its duration, the `forward` of each plain float32 CPU `nn.Linear` (exact
   type, no accelerate/DeepSpeed hook, no sharded weight) with `_Linear`, whose forward and both backward products
   go through `linear`/`matmul`. Module hooks and wrappers around the layer (PEFT's LoRA calls its base layer) run
   as before, and activation checkpointing recomputes through the same function, so the saved tensors match.

Shapes: `M` rows, `E` input features, `N` output features.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ADDMM_BLOCK_ROWS", "MIN_MACS", "addmm_", "fast_linears", "linear", "matmul", "onednn_preferred"]

MIN_MACS = 2**20
ADDMM_BLOCK_ROWS = 16384  # `addmm_`'s rows per oneDNN product (a [16384, 896] float32 temporary is 59 MB)

_preferred: bool | None = None  # onednn_preferred()'s measurement, once per process


def _onednn_op():
    ops = getattr(torch.ops, "mkldnn", None)
    return getattr(ops, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_preferred() -> bool:
    """Whether float32 CPU products go through oneDNN in this process: `GRPO_TRAINER_ONEDNN` if set, else timed once
    (a [256, 1024] x [1024, 1024] product, the best of three runs each; oneDNN must take under 0.8x the time)."""
    global _preferred
    if _preferred is None:
        forced = os.environ.get("GRPO_TRAINER_ONEDNN")
        if _onednn_op() is None:
            _preferred = False
        elif forced is not None:
            _preferred = forced.strip().lower() not in ("0", "false", "no", "off", "")
        else:
            _preferred = _measure()
    return _preferred


def _measure() -> bool:
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(256, 1024, generator=generator), torch.randn(1024, 1024, generator=generator)
    try:
        _onednn_linear(x, weight, None)
    except RuntimeError:  # a build whose op refuses plain weights: keep PyTorch's path
        return False
    best = {"blas": float("inf"), "onednn": float("inf")}
    with torch.no_grad():
        for _ in range(3):
            for name, run in (("blas", F.linear), ("onednn", _onednn_linear)):
                started = time.perf_counter()
                run(x, weight, None)
                best[name] = min(best[name], time.perf_counter() - started)
    return best["onednn"] < 0.8 * best["blas"]


def _eligible(x: Tensor, weight: Tensor, rows: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and rows * weight.shape[0] * weight.shape[1] >= MIN_MACS and not torch.is_autocast_enabled("cpu")
            and onednn_preferred())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` (`x` `[..., E]`, `weight` `[N, E]`), through oneDNN where decision 1 and 2 say so.
    Differentiable: with gradients wanted it goes through `_Linear`."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not _eligible(x, weight, rows):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _onednn_linear(x.reshape(rows, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` for 2-D `a` `[M, K]` and `b` `[K, N]` (any strides, transposed views included), without autograd:
    for products inside a backward pass (`g @ W`, `g.T @ x`)."""
    if not _eligible(a, b.t(), a.shape[0]):
        return a @ b
    return _onednn_linear(a, b.t(), None)


def addmm_(out: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """`out += alpha * (a @ b)` in place (`out` `[M, N]`, `a` `[M, K]`, `b` `[K, N]`). oneDNN writes a new tensor, so
    there the product is taken `ADDMM_BLOCK_ROWS` rows of `out` at a time: the temporary stays that small (an LM
    head's weight gradient is `[V, E]`, hundreds of MB at a 152k vocabulary)."""
    if not _eligible(a, b.t(), a.shape[0]):
        return out.addmm_(a, b, alpha=alpha)
    block = ADDMM_BLOCK_ROWS
    for start in range(0, out.shape[0], block):
        product = _onednn_linear(a[start:start + block], b.t(), None)
        out[start:start + block].add_(product, alpha=alpha)
    return out


class _Linear(torch.autograd.Function):
    """`x @ weight.T + bias` with the forward product and both backward products through oneDNN. Saves what
    autograd's own linear saves (`x` and `weight`); a frozen weight (LoRA's base layer) costs no weight product."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])  # [M, E]
        return _onednn_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])  # [M, N]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul(flat_grad, weight).view(x.shape)  # [M, N] @ [N, E]
        if ctx.needs_input_grad[1]:
            grad_weight = matmul(flat_grad.t(), x.reshape(-1, x.shape[-1]))  # [N, M] @ [M, E]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _fast_forward(module: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        return linear(x, module.weight, module.bias)

    return forward


def _plain(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and weight is not None and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor and not hasattr(weight, "ds_id")
            and not hasattr(module, "_hf_hook") and "forward" not in module.__dict__)


@contextlib.contextmanager
def fast_linears(*models: nn.Module | None) -> Iterator[None]:
    """Within this context every plain float32 CPU `nn.Linear` of `models` computes through `linear` (decision 3);
    nothing changes where oneDNN is not preferred. The modules get their own `forward` back on exit."""
    patched = []
    try:
        if onednn_preferred():
            for model in filter(None, models):
                for module in model.modules():
                    if _plain(module):
                        module.forward = _fast_forward(module)
                        patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
