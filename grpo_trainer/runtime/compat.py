"""Everything that differs between the transformers releases grpo_trainer supports, in one place.

Supported: transformers 5.x from `FLOOR` (setup.cfg's lower bound, which CI tests through
`scripts/test_floor.sh`) to the newest 5.x release. Elsewhere the code is written against the newest API and calls
this module where an older release spells something differently or lacks it. Each difference is detected from
transformers itself (`hasattr`, a dataclass field), never from a version number, and its comment names the release
that introduced the newer form, so that raising `FLOOR` past it tells which branch to delete.

Decisions:

1. Activation checkpointing (transformers 5.23 renamed gradient checkpointing): `TrainingArguments` gained
   `activation_checkpointing` / `activation_checkpointing_kwargs` (the `gradient_checkpointing*` names became
   deprecated aliases that mirror them) and models gained `activation_checkpointing_enable/_disable` and
   `is_activation_checkpointing`. On older releases `CheckpointingFields` adds the new names to `GRPOConfig`, so a
   script written for either release runs on both; `resolve_checkpointing` gives both names one value, as 5.23 does.
2. The fast backend's model-forward tier passes the KV cache under the name the model's forward takes
   (`cache` from transformers 5.24, `past_key_values` before).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import transformers
from packaging.version import Version
from torch import nn
from transformers import DynamicCache, PretrainedConfig, TrainingArguments

__all__ = ["BACKPORTED_FIELDS", "FLOOR", "CheckpointingFields", "cache_argument", "checkpointing_is_on",
           "default_checkpointing_kwarg", "disable_checkpointing", "enable_checkpointing", "has_linear_attention",
           "mirror_checkpointing", "resolve_checkpointing"]

FLOOR = "5.19.0"  # setup.cfg's lower bound; tests/runtime/test_transformers_compat.py checks the two agree

if Version(transformers.__version__) < Version(FLOOR):  # e.g. installed with --no-deps next to another package
    raise ImportError(f"grpo_trainer needs transformers >= {FLOOR} (installed: {transformers.__version__}); "
                      f"upgrade it with: pip install 'transformers>={FLOOR},<6'")

# --------------------------------------------------------------------------------- 1. activation checkpointing

# transformers 5.23: `activation_checkpointing*` in TrainingArguments, `gradient_checkpointing*` its aliases.
_ARGS_HAVE_ACTIVATION_NAMES = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
_CHECKPOINTING_NAMES = (("gradient_checkpointing", "activation_checkpointing"),
                        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))
# Keys of `activation_checkpointing_kwargs` that transformers 5.23 reads itself (the rest go to torch's checkpoint).
_NEWER_CHECKPOINTING_KEYS = ("every_n_layers", "offload")


@dataclass
class _ActivationCheckpointingNames:
    """transformers >= 5.23's names for gradient checkpointing, for releases before it (decision 1)."""

    activation_checkpointing: bool | None = field(default=None, metadata={
        "help": "Activation checkpointing: recompute each layer's activations in the backward pass instead of "
                "keeping them (less memory, one more forward). None: on. Alias of gradient_checkpointing."})
    activation_checkpointing_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Keyword arguments of torch.utils.checkpoint.checkpoint. Alias of gradient_checkpointing_kwargs."})
    # Redeclared with None ("not set") so that a default can be told from an explicit False.
    gradient_checkpointing: bool | None = field(default=None, metadata={
        "help": "Gradient (activation) checkpointing; the same setting as activation_checkpointing."})


@dataclass
class _NoNames:
    """transformers >= 5.23 declares both names itself."""


CheckpointingFields = _NoNames if _ARGS_HAVE_ACTIVATION_NAMES else _ActivationCheckpointingNames
BACKPORTED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(CheckpointingFields) if f.name not in TrainingArguments.__dataclass_fields__)


def resolve_checkpointing(args: TrainingArguments, default: bool) -> None:
    """Before `TrainingArguments.__post_init__`: `default` where neither name is set, and on releases before 5.23
    both names given one value, the new name winning as in 5.23 (decision 1)."""
    if _ARGS_HAVE_ACTIVATION_NAMES:  # transformers resolves its deprecated alias itself
        if args.activation_checkpointing is None and args.gradient_checkpointing is None:
            args.activation_checkpointing = default
        return
    for old, new in _CHECKPOINTING_NAMES:
        if getattr(args, new) is None:
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))
    if args.activation_checkpointing is None:
        args.activation_checkpointing = args.gradient_checkpointing = default
    kwargs = args.activation_checkpointing_kwargs
    newer = [key for key in _NEWER_CHECKPOINTING_KEYS if isinstance(kwargs, dict) and key in kwargs]
    if newer:
        raise ValueError(f"activation_checkpointing_kwargs {newer} need transformers >= 5.23 (installed: "
                         f"{transformers.__version__}); upgrade transformers or remove them.")


def mirror_checkpointing(args: TrainingArguments) -> None:
    """After `TrainingArguments.__post_init__` (which parsed `gradient_checkpointing_kwargs` from JSON on releases
    before 5.23): the new names hold the same values."""
    if not _ARGS_HAVE_ACTIVATION_NAMES:
        for old, new in _CHECKPOINTING_NAMES:
            setattr(args, new, getattr(args, old))


def default_checkpointing_kwarg(args: TrainingArguments, key: str, value: Any) -> None:
    """`key` of torch's checkpoint kwargs set to `value` under both names, unless the user set it."""
    names = [new for _, new in _CHECKPOINTING_NAMES[1:]] + [old for old, _ in _CHECKPOINTING_NAMES[1:]]
    kwargs = next((dict(getattr(args, n)) for n in names if isinstance(getattr(args, n, None), dict)), {})
    kwargs.setdefault(key, value)
    for name in names:
        if hasattr(args, name):
            setattr(args, name, dict(kwargs))


def enable_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """Turn activation checkpointing on, as `Trainer.train` does (`activation_checkpointing_enable`, 5.23)."""
    if hasattr(type(model), "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)


def disable_checkpointing(model: nn.Module) -> None:
    if hasattr(type(model), "activation_checkpointing_disable"):  # transformers 5.23
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_is_on(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (`is_activation_checkpointing`, 5.23; the older name warns there)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


# ---------------------------------------------------------------------------------------------- 2. the cache


def cache_argument(lm: nn.Module) -> str:
    """The keyword under which `lm.forward` takes its KV cache (decision 2)."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"  # `cache`: 5.24


def has_linear_attention(config: PretrainedConfig) -> bool:
    """Whether the dynamic cache `generate` builds for `config` holds linear-attention (recurrent) layers."""
    return any(DynamicCache(config=config).is_linear)
