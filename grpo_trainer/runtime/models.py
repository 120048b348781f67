"""Model loading, PEFT wrapping, the reference model and reward models.

Decisions:

1. The reference model is None when `beta == 0`. Under PEFT it is the policy itself with the adapter disabled
   (no second copy in memory). Otherwise it is a frozen copy, prepared for DeepSpeed like the policy.
2. A model given by id is loaded in float32 unless `model_init_kwargs['dtype']` says otherwise (as TRL does);
   `trust_remote_code` stays False unless the user sets it.
3. Optional dependencies (peft, deepspeed) are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

__all__ = ["causal_lm", "disable_dropout", "is_checkpointing", "is_peft_model", "load_policy", "load_reward_model",
           "make_reference_model", "reference_context", "wrap_peft"]


def _init_kwargs(model_init_kwargs: dict | None) -> dict:
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.get("dtype", kwargs.pop("torch_dtype", None))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = torch.float32 if dtype is None else dtype
    return kwargs


def load_policy(model: str | nn.Module, model_init_kwargs: dict | None,
                quantization_config: Any = None) -> nn.Module:
    """A causal LM from a Hub id or a local path; a model that is already loaded is returned as it is."""
    if not isinstance(model, str):
        if quantization_config is not None:
            raise ValueError("quantization_config applies only when `model` is a Hub id or a local path; this model "
                             "is already loaded. Pass its id/path, or load it with quantization_config yourself.")
        return model
    kwargs = _init_kwargs(model_init_kwargs)
    if quantization_config is not None and kwargs.get("quantization_config") is not None:
        raise ValueError("quantization_config is set both as a trainer argument and in args.model_init_kwargs; "
                         "set it in one place (the trainer argument).")
    quantization_config = quantization_config or kwargs.get("quantization_config")
    if quantization_config is not None:
        if not torch.cuda.is_available():  # checked before any weight is read
            raise ValueError("quantization_config (QLoRA / 4-bit) needs a CUDA GPU, and none is available; drop "
                             "quantization_config to train in full precision with LoRA.")
        kwargs["quantization_config"] = quantization_config
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def load_reward_model(model_id: str, model_init_kwargs: dict | None) -> tuple[nn.Module, Any]:
    """A sequence-classification reward model (one label) and its tokenizer."""
    model = AutoModelForSequenceClassification.from_pretrained(model_id, num_labels=1,
                                                               **_init_kwargs(model_init_kwargs))
    return model, AutoTokenizer.from_pretrained(model_id)


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside DDP / DeepSpeed / PEFT wrappers (LoRA layers stay in place)."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if is_peft_model(model) else model


def is_checkpointing(lm: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, under either of transformers' names for it."""
    flag = getattr(type(lm), "is_activation_checkpointing", None)
    return bool(lm.is_activation_checkpointing if flag is not None else getattr(lm, "is_gradient_checkpointing", False))


def wrap_peft(model: PreTrainedModel, peft_config: Any, gradient_checkpointing: bool) -> nn.Module:
    """Wrap `model` with a fresh adapter; only the adapter trains."""
    from peft import get_peft_model

    if is_peft_model(model):
        raise ValueError("model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
    targets = getattr(peft_config, "target_modules", None) or []
    if "lm_head" in targets or "lm_head" in (getattr(peft_config, "modules_to_save", None) or []):
        raise ValueError("peft_config adapts lm_head; log-probs read the LM head directly, so leave lm_head out "
                         "of target_modules and modules_to_save.")
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return get_peft_model(model, peft_config)


def make_reference_model(model: nn.Module, beta: float) -> nn.Module | None:
    """The frozen reference policy, or None when it is not needed (beta == 0) or is the adapter-free policy."""
    if beta == 0.0:
        return None
    if is_peft_model(model):
        if any(p.any() for name, p in model.named_parameters() if "lora_B" in name):
            warnings.warn("the PeftModel's adapter is already trained (non-zero lora_B), but the KL reference is "
                          "the base model with the adapter disabled, not this starting point. To measure KL from "
                          "it, merge it (merge_and_unload()) and pass the merged model with peft_config.")
        return None
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def reference_context(policy: nn.Module) -> Iterator[None]:
    """Under PEFT, run the policy as the reference model by disabling its adapter."""
    while hasattr(policy, "module") and not is_peft_model(policy):  # DDP / DeepSpeed wrappers
        policy = policy.module
    with policy.disable_adapter():
        yield


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
