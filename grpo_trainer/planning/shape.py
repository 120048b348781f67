"""A model's `ModelShape`, from its config alone (`model_shape`): the model is built on the meta device (shapes, no
storage, no weights read), its parameters counted, and an adapter config applied to it the way the trainer applies
it, so the adapter's parameter count is PEFT's own, whatever its `target_modules` say. `shape_of` reads the same from
a model already built (the memory check's, for a PEFT model it is given): the one place the planner reads a model
it is given.

Building on the meta device takes well under a second at any size, and covers every architecture transformers
builds (tied heads, biases, q/k norms, Mixture-of-Experts) without per-family formulas.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from grpo_trainer.modeling import routing, tied_embedding
from grpo_trainer.planning.settings import ModelShape

__all__ = ["model_shape", "shape_of"]


def model_shape(config: Any, adapter_config: Any = None, trust_remote_code: bool = False) -> ModelShape:
    """The `ModelShape` of a causal LM built from `config` (a transformers `PretrainedConfig`), with the adapter of
    `adapter_config` (a PEFT config, e.g. `LoraConfig`) when given. `trust_remote_code`: a config whose model is
    code shipped with the checkpoint (only for code you trust, as when loading it)."""
    model = _meta_model(config, trust_remote_code)
    return shape_of(model, _text_config(config), adapter_config)


def shape_of(model: nn.Module, text_config: Any, adapter_config: Any = None) -> ModelShape:
    """The `ModelShape` of an instantiated model (meta or real); `adapter_config` is applied to a meta copy only.
    An already wrapped PEFT model counts its own trainable parameters as the adapter."""
    base_parameters = {id(p): p for n, p in model.named_parameters() if not _is_adapter("." + n)}
    layers = _decoder_layers(model)
    layer_parameters = sum(p.numel() for n, p in layers[0].named_parameters() if not _is_adapter("." + n)) \
        if layers else 0
    linear = sum(m.weight.numel() for layer in layers for n, m in layer.named_modules()
                 if isinstance(m, nn.Linear) and not _is_adapter("." + n))
    trained = model
    if not _is_peft(model) and adapter_config is not None:
        trained = _with_adapter(model, adapter_config)
    adapted = trained is not model or _is_peft(model)
    trainable = [p for p in trained.parameters() if p.requires_grad] if adapted else list(base_parameters.values())
    heads = text_config.num_attention_heads
    routers = _routers(model)
    return ModelShape(
        model_type=getattr(text_config, "model_type", "unknown"),
        vocab=text_config.vocab_size,
        hidden=text_config.hidden_size,
        intermediate=getattr(text_config, "intermediate_size", None) or 4 * text_config.hidden_size,
        layers=len(layers) or text_config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        tied_head=bool(getattr(text_config, "tie_word_embeddings", False)),
        plain_lookup=_plain_lookup(model),
        parameters=sum(p.numel() for p in base_parameters.values()),
        layer_parameters=layer_parameters,
        linear_parameters=linear,
        largest_parameter=max(p.numel() for p in base_parameters.values()),
        adapter_parameters=sum(p.numel() for p in trainable) if adapted else 0,
        factored_state=sum(sum(p.shape) if p.dim() == 2 else p.numel() for p in trainable),
        **_kept_inputs(_decoder_layers(trained)[0] if layers else None),
        routed_layers=len(routers), routed_top_k=max((r.top_k for r in routers), default=0),
        experts=max((r.experts for r in routers), default=0),
    )


def _plain_lookup(model: nn.Module) -> bool:
    """Whether the input embedding is a plain `nn.Embedding` lookup (`modeling.tied_embedding`, decision 4)."""
    return tied_embedding.plain_lookup(model.get_input_embeddings())


def _routers(model: nn.Module) -> list:
    """The model's MoE routers, found by structure as routing replay finds them (none for a model laid out
    otherwise)."""
    try:
        return routing.find_routers(model)
    except AttributeError:  # no decoder layers where routing looks for them
        return []


# A Llama-family layer's linear modules by role (fused projections count once: one input, one copy)
_ROLES = {"attention": ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"), "output": ("o_proj",),
          "mlp": ("gate_proj", "up_proj", "gate_up_proj"), "down": ("down_proj",)}


def _kept_inputs(layer: nn.Module | None) -> dict:
    """Which linear modules of `layer` keep their input for the backward: a trained weight, or an adapter without
    dropout (with dropout the adapter keeps its dropped copy, counted in `dropout_inputs`); and whether the norms
    train. Layers without Llama-family module names keep the defaults (everything trained)."""
    if layer is None:
        return {}
    roles = {role: [] for role in _ROLES}
    dropout_inputs, norms_trained = 0, False
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        role = next((r for r, names in _ROLES.items() if leaf in names), None)
        if "norm" in leaf and any(p.requires_grad for p in module.parameters(recurse=False)):
            norms_trained = True
        if role is None:
            continue
        adapters = getattr(module, "lora_A", None)
        dropout = [d for d in getattr(module, "lora_dropout", {}).values() if not isinstance(d, nn.Identity)]
        base = getattr(module, "base_layer", module)
        trained = any(p.requires_grad for p in base.parameters(recurse=False))
        if adapters and dropout:
            dropout_inputs += base.in_features
        roles[role].append(trained or bool(adapters) and not dropout)
    if not any(roles.values()):
        return {}
    return {"attention_inputs_kept": sum(roles["attention"]), "output_input_kept": any(roles["output"]),
            "mlp_inputs_kept": sum(roles["mlp"]), "down_input_kept": any(roles["down"]),
            "norms_trained": norms_trained, "dropout_inputs": dropout_inputs}


def _text_config(config: Any) -> Any:
    """A vision-language model's text config (its decoder's sizes), else the config itself."""
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def _meta_model(config: Any, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None \
        else AutoModelForCausalLM
    with torch.device("meta"), warnings.catch_warnings(), _no_zero3_init():
        warnings.simplefilter("ignore")
        return auto.from_config(config, trust_remote_code=trust_remote_code)


@contextlib.contextmanager
def _no_zero3_init() -> Iterator[None]:
    """Under a ZeRO-3 launch transformers builds every model inside `deepspeed.zero.Init`, which partitions (copies)
    its parameters: impossible for meta tensors. Its switch is the global DeepSpeed config it holds (private API:
    `transformers.integrations.deepspeed`), cleared here while the meta model is built."""
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's layers: the longest `nn.ModuleList` of the model (the decoder stack of any architecture)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and not _is_adapter_list(m)]
    return list(max(lists, key=len)) if lists else []


def _is_adapter(name: str) -> bool:
    return ".lora_" in name or ".modules_to_save." in name or ".original_module." in name


def _is_adapter_list(module: nn.ModuleList) -> bool:
    return type(module).__module__.startswith("peft")


def _is_peft(model: nn.Module) -> bool:
    with contextlib.suppress(ImportError):
        from peft import PeftModel

        return isinstance(model, PeftModel)
    return False


def _with_adapter(model: nn.Module, adapter_config: Any) -> nn.Module:
    """`model` (moved to the meta device if it is not there) wrapped by PEFT with `adapter_config`: PEFT's own
    choice of modules and shapes, on tensors without storage."""
    import copy

    from peft import get_peft_model

    meta = model if next(model.parameters()).is_meta else copy.deepcopy(model).to("meta")
    with torch.device("meta"), warnings.catch_warnings(), _no_zero3_init():
        warnings.simplefilter("ignore")
        return get_peft_model(meta, copy.deepcopy(adapter_config))
