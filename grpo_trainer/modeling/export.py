"""The policy's weights as an inference engine loads them: Hugging Face checkpoint names, one tensor at a time.

Decisions:

1. Names are those of the model's own checkpoint (`model.layers.0.self_attn.q_proj.weight`), without the wrappers
   training adds: PEFT's `base_model.model.` and `.base_layer`, `modules_to_save.<adapter>.` (the trained copy
   replaces the original module, whose weights are skipped), activation checkpointing's `_checkpoint_wrapped_module.`.
2. A tied weight is yielded under every name that holds it (`lm_head.weight` as well as the embedding's): engines
   such as vLLM's CPU build keep a separate packed copy of the LM head and would otherwise keep a stale one.
3. Memory stays bounded by one parameter: each is gathered when it is reached (a ZeRO-3 partition through
   `GatheredParameters`, an FSDP2 DTensor through `full_tensor`) and released before the next. Gathering is a
   collective, so every process must iterate, even those that send nothing.
4. LoRA is merged without touching the model, by `modeling.lora`'s one rule (the fast decoder's too): a LoRA
   linear layer yields W + (B A) * scaling and, with `lora_bias`, b + B.bias * scaling, computed from its gathered
   base, A and B weights. Other adapter types (DoRA, LoRA on embeddings or convolutions, other tuners) fall back to
   PEFT's `merge_adapter` / `unmerge_adapter` around the iteration, which needs every parameter gathered at once
   under ZeRO-3 (as in TRL) and rounds the base weights by one add and one subtract. `lora_bias=True` on a layer
   without a bias is refused by name (`check_exportable`): no merge can express it.
5. Quantized base weights (bitsandbytes) are refused: their merged full-precision values would need dequantising,
   which this module does not do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_trainer.modeling import lora
from grpo_trainer.modeling.unwrap import is_peft_model

__all__ = ["check_exportable", "inference_weight_metadata", "inference_weights"]

_STRIP = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _checkpoint_name(name: str, adapter: str | None) -> str | None:
    """The checkpoint name of a training parameter name (decision 1); None for a tensor the engine must not get."""
    if adapter is not None:
        if "lora_" in name or ".original_module." in name:
            return None
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace(f".modules_to_save.{adapter}", "")
    for prefix in _STRIP:
        name = name.replace(prefix, "")
    return name


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter]) -> Iterator[None]:
    """Full values of ZeRO-3 partitioned `params` inside the block (a no-op for any other parameter)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield


def _full(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _lora_layers(model: nn.Module) -> tuple[dict[str, nn.Module], bool]:
    """The LoRA layers that `modeling.lora`'s rule merges on the fly, by module name, and whether every adapter layer
    of the model is one of them (decision 4)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    simple, all_simple = {}, True
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if lora.merge_blocker(module) is None and not module.merged and lora.agrees_with_peft(module):
            simple[name] = module
        else:
            all_simple = False
    return simple, all_simple


def check_exportable(model: nn.Module) -> None:
    """ValueError for a policy whose weights cannot be exported (decision 5), naming the layer."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("bitsandbytes"):
            raise ValueError(f"the policy has bitsandbytes-quantized layers ({name}: {type(module).__name__}); "
                             "pushing its weights into an inference engine (use_vllm) is not supported for quantized "
                             "models. Train without quantization_config, or with use_vllm=False.")
        reason = lora.merge_blocker(module) if hasattr(module, "lora_bias") else None
        if reason is not None and "lora_bias" in reason:
            raise ValueError(f"the policy's LoRA layer {name}: {reason}. Its weights cannot be pushed into an "
                             "inference engine (use_vllm). Set lora_bias=False in the LoraConfig, or use_vllm=False.")


def inference_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, full tensor) for every weight of `model` (the trainer's unwrapped policy, possibly a
    PeftModel, ZeRO-3 partitioned or FSDP2-sharded), one at a time. A collective: every process must exhaust it.
    Each tensor is valid until the next one is requested."""
    check_exportable(model)
    adapter = model.active_adapter if is_peft_model(model) else None
    layers, all_simple = _lora_layers(model) if adapter is not None else ({}, True)
    merge = contextlib.nullcontext()
    if not all_simple:  # decision 4's fall-back: PEFT merges in place, with everything gathered
        merge, layers = _merged_in_place(model), {}
    with merge:
        for full_name, param in model.named_parameters(remove_duplicate=False):
            name = _checkpoint_name(full_name, adapter)
            if name is None:
                continue
            owner, _, kind = full_name.rpartition(".base_layer.")
            layer = layers.get(owner) if kind in ("weight", "bias") else None
            if layer is not None:
                adapters = lora.active_adapters(layer)
                factors = [p for a in adapters for p in layer.lora_A[a].parameters()] + \
                          [p for a in adapters for p in layer.lora_B[a].parameters()]
                merge = lora.applied_weight if kind == "weight" else lora.applied_bias
                with _gathered([param, *factors]), torch.no_grad():
                    yield name, merge(layer, _full)
            else:
                with _gathered([param]):
                    yield name, _full(param).detach()


def inference_weight_metadata(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(checkpoint name, dtype, full shape) of what `inference_weights` yields, in the same order, without gathering
    anything (a ZeRO-3 partition knows its full shape, an FSDP2 DTensor its global one)."""
    adapter = model.active_adapter if is_peft_model(model) else None
    out = []
    for full_name, param in model.named_parameters(remove_duplicate=False):
        name = _checkpoint_name(full_name, adapter)
        if name is not None:
            out.append((name, param.dtype, tuple(getattr(param, "ds_shape", None) or param.shape)))
    return out


@contextlib.contextmanager
def _merged_in_place(model: nn.Module) -> Iterator[None]:
    with _gathered(list(model.parameters())), torch.no_grad():
        model.merge_adapter()
        try:
            yield
        finally:
            model.unmerge_adapter()
