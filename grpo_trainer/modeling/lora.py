"""One rule for the weight and bias a PEFT LoRA linear layer applies: used by the fast decoder (which runs merged
weights in its fused projections) and by the weight export to inference engines (`export`).

Decisions:

1. Vanilla LoRA is merged on the fly, without touching the model: W' = W + sum over active adapters of
   transpose(B A, fan_in_fan_out) * scaling (rank-stabilised scaling is in PEFT's `scaling`), computed in float32
   and cast to W's dtype once; with `lora_bias=True`, b' = b + sum of B.bias * scaling (PEFT's merge). A layer whose
   adapters are already merged applies W itself; a disabled adapter, W alone.
2. Anything else is not merged here (`merge_blocker` says why): other variants (DoRA: its magnitude renormalises
   the merged weight), layer types other than PEFT's `lora.Linear` (quantised, embedding, convolution), and
   `lora_bias=True` on a base layer without a bias (PEFT cannot merge that either: the merged model would need a
   bias the checkpoint does not have). Callers fall back to the module's own forward (the decoder) or to PEFT's own
   in-place merge, or refuse by name (`export`).
3. The formula re-implements PEFT's `merge`, so it checks itself against PEFT once per process and layer type
   (`agrees_with_peft`): the first layer merged is compared with `base.weight + get_delta_weight(adapter)`; if they
   differ, on-the-fly merging is off for the process and every layer falls back (logged), never silently wrong.
   Sharded layers (ZeRO-3, FSDP2) are not compared (their local data is not the full weight); the first unsharded
   one is.

Shapes: `O` output features, `I` input features, `r` the adapter's rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["active_adapters", "agrees_with_peft", "applied_bias", "applied_weight", "merge_blocker"]

logger = logging.getLogger(__name__)

Value = Callable[[Tensor], Tensor]  # a parameter's full value (identity, or a sharded parameter's gather)

_CHECKED: dict[type, bool] = {}  # decision 3: LoRA layer type -> whether our merge agreed with PEFT's


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _lora_linear_type() -> type | None:
    try:
        from peft.tuners.lora import Linear
    except ImportError:
        return None
    return Linear


def active_adapters(layer: nn.Module) -> list[str]:
    """The layer's active adapters that it holds LoRA weights for."""
    return [a for a in layer.active_adapters if a in layer.lora_A]


def merge_blocker(layer: nn.Module) -> str | None:
    """Why `layer` cannot be merged by this module's rule (decision 2), or None when it can."""
    lora_linear = _lora_linear_type()
    if lora_linear is None or type(layer) is not lora_linear:
        return f"{type(layer).__name__} is not PEFT's LoRA Linear"
    adapters = active_adapters(layer)
    variants = [a for a in adapters if a in getattr(layer, "lora_variant", {})]
    if variants:
        name = type(layer.lora_variant[variants[0]]).__name__
        return f"adapter {variants[0]!r} is a LoRA variant ({name}, e.g. DoRA)"
    biased = [a for a in adapters if getattr(layer, "lora_bias", {}).get(a, False)]
    if biased and getattr(layer.base_layer, "bias", None) is None:
        return (f"adapter {biased[0]!r} has lora_bias=True on a layer without a bias (PEFT cannot merge it: the "
                "merged model would need a bias its checkpoint does not have)")
    return None


def _delta(layer: nn.Module, adapter: str, value: Value) -> Tensor:
    """transpose(B A, fan_in_fan_out) * scaling `[O, I]` (`[I, O]` for fan_in_fan_out) in float32."""
    delta = value(layer.lora_B[adapter].weight).float() @ value(layer.lora_A[adapter].weight).float()  # [O, r]@[r, I]
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]


def applied_weight(layer: nn.Module, value: Value = _identity) -> Tensor:
    """The weight `layer` applies now (decision 1). Call only where `merge_blocker(layer)` is None."""
    weight = value(layer.base_layer.weight).detach()
    if layer.merged or layer.disable_adapters or not active_adapters(layer):
        return weight
    merged = weight.float()
    for adapter in active_adapters(layer):
        merged = merged + _delta(layer, adapter, value)
    return merged.to(weight.dtype)


def applied_bias(layer: nn.Module, value: Value = _identity) -> Tensor | None:
    """The bias `layer` applies now (decision 1); None for a layer without one."""
    bias = getattr(layer.base_layer, "bias", None)
    if bias is None:
        return None
    bias = value(bias).detach()
    biased = [a for a in active_adapters(layer) if getattr(layer, "lora_bias", {}).get(a, False)]
    if layer.merged or layer.disable_adapters or not biased:
        return bias
    merged = bias.float()
    for adapter in biased:
        merged = merged + value(layer.lora_B[adapter].bias).float() * layer.scaling[adapter]
    return merged.to(bias.dtype)


def agrees_with_peft(layer: nn.Module) -> bool:
    """Decision 3: once per process and layer type, whether `applied_weight`/`applied_bias` equal PEFT's own merge
    (`base + get_delta_weight`, and PEFT's bias rule) on this unsharded layer."""
    kind = type(layer)
    if kind not in _CHECKED:
        adapters = active_adapters(layer)
        if layer.merged or layer.disable_adapters or not adapters or any(_sharded(p) for p in layer.parameters()):
            return True  # nothing to compare here: decide on the first unsharded layer that merges something
        with torch.no_grad():
            theirs = layer.base_layer.weight.float()
            for adapter in adapters:
                theirs = theirs + layer.get_delta_weight(adapter).float()
            ours = applied_weight(layer).float()
            tolerance = 1e-5 if ours.dtype == layer.base_layer.weight.dtype == torch.float32 else 1e-2
            agree = bool(torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance))
        _CHECKED[kind] = agree
        if not agree:
            logger.warning("merging LoRA weights on the fly does not reproduce PEFT %s's merge for %s; every LoRA "
                           "layer falls back to the module's forward or PEFT's in-place merge in this process.",
                           _peft_version(), kind.__name__)
    return _CHECKED[kind]


def _sharded(param: Tensor) -> bool:
    """A ZeRO-3 partition or an FSDP2 DTensor: its local data is not the full value PEFT's merge would read."""
    from torch.distributed.tensor import DTensor

    return hasattr(param, "ds_id") or isinstance(param, DTensor)


def _peft_version() -> str:
    try:
        import peft
    except ImportError:
        return "?"
    return peft.__version__
