"""The model behind the wrappers training adds: DDP / DeepSpeed engines (`.module`), FSDP, and PEFT.

One rule for every caller (rollout backends, log-prob forwards, weight export, the trainer): unwrap `.module` until
none is left, then PEFT's `get_base_model()`. LoRA layers stay in place inside the returned causal LM, so its
forward still applies the adapter.
"""

from __future__ import annotations

from torch import nn

__all__ = ["causal_lm", "is_peft_model", "is_zero3_partitioned", "output_head"]


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


def output_head(model: nn.Module) -> nn.Module:
    """The LM head of a model behind any wrappers (DDP `.module`, DeepSpeed engine, PEFT)."""
    head = causal_lm(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head); a causal LM is required.")
    return head


def is_zero3_partitioned(model: nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 already partitioned the model's parameters (e.g. loaded under `zero.Init`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())
