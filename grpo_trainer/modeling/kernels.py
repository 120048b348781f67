"""Float32 CPU matrix products through oneDNN where that library is the faster one: the fast decoder's
projections and LM head, the LM-head log-probs and their backward, and (`fast_linears`) every large `nn.Linear` of a
model while it trains.

PyTorch sends float32 CPU matmuls to the BLAS it was built with (MKL on x86 builds). MKL chooses its kernels by CPU
vendor, so on some CPUs (AMD processors with AVX-512, for one) its `sgemm` runs kernels that reach about half of
what the oneDNN kernels shipped in the same PyTorch build reach (`torch.ops.mkldnn._linear_pointwise`, the kernel
inductor emits for CPU linears). Both compute the same float32 products; only the order of the sums differs, so
results agree to float rounding, as two BLAS libraries do.

Decisions:

1. Deterministic for a machine and its settings, measured, not assumed. Which library is faster depends on the CPU
   and on the product's shape (on one Intel Xeon here, MKL and oneDNN are within 15% on training-width products,
   and oneDNN is 2x faster on a decode step's LM head, `[8, 896] x [896, 151936]`; on an AMD EPYC oneDNN was faster
   on both). So the choice is made per class of product, narrow (fewer than `NARROW_ROWS` rows: decoding) and wide
   (training), from one measurement per machine (`KernelChoice`), stored in a cache file keyed by the CPU model,
   torch version and thread count: every later run on that machine makes the same choice, whatever its load.
   `GRPO_TRAINER_ONEDNN=0` / `=1` forces the choice (and skips the measurement). Before oneDNN is used at all, its
   result is checked against `F.linear` on a seeded product; where they differ beyond float32 rounding, oneDNN is
   never used in the process (logged).
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
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ADDMM_BLOCK_ROWS", "MIN_MACS", "NARROW_ROWS", "KernelChoice", "addmm_", "fast_linears", "kernel_choice",
           "linear", "matmul", "onednn_preferred"]

logger = logging.getLogger(__name__)

MIN_MACS = 2**20
ADDMM_BLOCK_ROWS = 16384  # `addmm_`'s rows per oneDNN product (a [16384, 896] float32 temporary is 59 MB)

NARROW_ROWS = 64  # products with fewer rows than this are "narrow" (a decode step: one token per row)
CACHE_ENV = "GRPO_TRAINER_CACHE"  # folder of the measurement cache (default ~/.cache/grpo_trainer)
_CLASSES = {"narrow": ((8, 896), (32768, 896)), "wide": ((256, 1024), (1024, 1024))}  # x [M, E], weight [N, E]


@dataclass(frozen=True)
class KernelChoice:
    """Which float32 CPU products go through oneDNN in this process (decision 1), and why."""

    narrow: bool  # products of fewer than NARROW_ROWS rows
    wide: bool
    source: str  # where the choice came from: the environment, the cache file, a measurement, or why oneDNN is off

    def for_rows(self, rows: int) -> bool:
        return self.narrow if rows < NARROW_ROWS else self.wide

    @property
    def any(self) -> bool:
        return self.narrow or self.wide


_choice: KernelChoice | None = None  # kernel_choice(), once per process


def _onednn_op():
    ops = getattr(torch.ops, "mkldnn", None)
    return getattr(ops, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def kernel_choice() -> KernelChoice:
    """This process's `KernelChoice` (decision 1), resolved on first use and logged once."""
    global _choice
    if _choice is None:
        _choice = _resolve()
        logger.info("float32 CPU products through oneDNN: narrow %s, wide %s (%s)", _choice.narrow, _choice.wide,
                    _choice.source)
    return _choice


def onednn_preferred(rows: int = 1) -> bool:
    """Whether a float32 CPU product of `rows` rows goes through oneDNN in this process (decision 1)."""
    return kernel_choice().for_rows(rows)


def _resolve() -> KernelChoice:
    if _onednn_op() is None:
        return KernelChoice(False, False, "this torch build has no oneDNN linear")
    forced = os.environ.get("GRPO_TRAINER_ONEDNN")
    if forced is not None:
        on = forced.strip().lower() not in ("0", "false", "no", "off", "")
        choice = KernelChoice(on, on, f"GRPO_TRAINER_ONEDNN={forced}")
    else:
        choice = _cached_measurement()
    if (choice.narrow or choice.wide) and (failure := _numeric_failure()) is not None:
        logger.warning("oneDNN's float32 linear disagrees with F.linear (%s); using PyTorch's own path.", failure)
        return KernelChoice(False, False, f"numeric check failed: {failure}")
    return choice


def _numeric_failure() -> str | None:
    """Why oneDNN's product is not `F.linear`'s up to float32 rounding, or None when it is (decision 1)."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((37, 300), (129, 300), (129,)))
    try:
        with torch.no_grad():
            ours, reference = _onednn_linear(x, weight, bias), F.linear(x, weight, bias)
    except RuntimeError as error:  # a build whose op refuses plain weights
        return f"the op raised {error}"
    difference = float((ours - reference).abs().max())
    tolerance = 1e-5 * float(reference.abs().max())
    return None if difference <= tolerance else f"max difference {difference:.3g} > {tolerance:.3g}"


def _machine_key() -> str:
    """The CPU model, torch version and thread count: what the measurement depends on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _cached_measurement() -> KernelChoice:
    """The stored measurement for this machine, else a new one, stored (decision 1)."""
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo_trainer")
    path, key = folder / "kernels.json", _machine_key()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return KernelChoice(table[key]["narrow"], table[key]["wide"], f"measured once on this machine, {path}")
    measured = {name: _measure(*shapes) for name, shapes in _CLASSES.items()}
    table[key] = measured
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(table, indent=1))
        temporary.replace(path)  # atomic: a concurrent run reads the old table or the new one
        where = f"measured now, stored in {path}"
    except OSError as error:
        where = f"measured now, not stored ({error})"
    return KernelChoice(measured["narrow"], measured["wide"], where)


def _measure(x_shape: tuple[int, int], weight_shape: tuple[int, int]) -> bool:
    """Whether oneDNN takes at most 0.8x the BLAS's time on this product: medians of 7 alternating runs each."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*x_shape, generator=generator), torch.randn(*weight_shape, generator=generator)
    times: dict[str, list[float]] = {"blas": [], "onednn": []}
    with torch.no_grad():
        F.linear(x, weight), _onednn_linear(x, weight, None)  # warm-up
        for _ in range(7):
            for name, run in (("blas", F.linear), ("onednn", _onednn_linear)):
                started = time.perf_counter()
                run(x, weight, None)
                times[name].append(time.perf_counter() - started)
    return statistics.median(times["onednn"]) <= 0.8 * statistics.median(times["blas"])


def _eligible(x: Tensor, weight: Tensor, rows: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and rows * weight.shape[0] * weight.shape[1] >= MIN_MACS and not torch.is_autocast_enabled("cpu")
            and onednn_preferred(rows))


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
        if kernel_choice().wide:  # a training forward's products have B x (S + T) rows
            for model in filter(None, models):
                for module in model.modules():
                    if _plain(module):
                        module.forward = _fast_forward(module)
                        patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
