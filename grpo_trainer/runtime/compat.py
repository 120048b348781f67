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
2. Gradient-accumulation scaling (transformers 5.19 added `Trainer.loss_is_scaled_for_ga`): GRPO losses already
   include it (`algorithms.losses`, decision 2). Before 5.19 `Trainer.training_step` divides `compute_loss`'s
   result by the window's micro-batch count again whenever it has not counted label tokens itself, which is always
   the case for GRPO's batches of rows, or a `compute_loss_func` is set; `loss_already_scaled` sets one (never
   called) for the duration of `training_step`. And before 5.6 the Trainer gave Accelerate the accumulation steps
   too, whose `backward` divided once more (except under DeepSpeed); `leave_accumulation_to_trainer` sets
   Accelerate's to 1, as 5.6 does. So the loss is backpropagated as computed, bit for bit.
3. The fast backend's model-forward tier passes the KV cache under the name the model's forward takes
   (`cache` from transformers 5.24, `past_key_values` before), and asks the dynamic cache whether any layer is
   linear attention (`DynamicCache.is_linear`, transformers 5.13); before it, a model with such layers kept a
   cache class of its own, which the tier already refuses.
4. Continuous batching: `generate_batch` takes a `ContinuousBatchingConfig` from transformers 5.4 on, and its `seed`
   (which the backend sets for reproducible rollouts) from 5.9; older releases get an error naming 5.9 (TRL 1.16
   accepts 5.8, where the engine cannot be seeded).
5. Replay (`rollout.replay`) makes each checkpointed decoder layer of the loss forward return the rollout's output
   without running. From transformers 5.2 the model's recorded outputs come from hooks and its final hidden state
   from its own output, so nothing is lost; before 5.2 the hidden states were collected by patching each decoder
   layer's `forward`, which a replayed layer never calls, so the loss forward would return none, and replay is
   off (`LAYER_REPLAY`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import transformers
from accelerate import Accelerator
from accelerate.utils import DistributedType
from packaging.version import Version
from torch import nn
from transformers import DynamicCache, PretrainedConfig, Trainer, TrainingArguments

__all__ = ["BACKPORTED_FIELDS", "CONTINUOUS_BATCHING_RELEASE", "FLOOR", "LAYER_REPLAY", "CheckpointingFields",
           "cache_argument", "checkpointing_is_on", "continuous_batching_blocker", "disable_checkpointing",
           "enable_checkpointing", "has_linear_attention", "leave_accumulation_to_trainer", "loss_already_scaled",
           "mirror_checkpointing",
           "resolve_checkpointing"]

FLOOR = "5.0.0"  # setup.cfg's lower bound; tests/runtime/test_transformers_compat.py checks the two agree

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


def resolve_checkpointing(args: Any, default: bool) -> None:
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


def mirror_checkpointing(args: Any) -> None:
    """After `TrainingArguments.__post_init__` (which parsed `gradient_checkpointing_kwargs` from JSON on releases
    before 5.23): the new names hold the same values."""
    if not _ARGS_HAVE_ACTIVATION_NAMES:
        for old, new in _CHECKPOINTING_NAMES:
            setattr(args, new, getattr(args, old))


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


# ------------------------------------------------------------------------------- 2. gradient-accumulation scaling

# transformers 5.19: `Trainer.training_step` reads `loss_is_scaled_for_ga` and leaves a scaled loss alone.
_TRAINER_READS_LOSS_IS_SCALED_FOR_GA = hasattr(Trainer, "loss_is_scaled_for_ga")


@contextlib.contextmanager
def loss_already_scaled(trainer: Trainer) -> Iterator[None]:
    """Around `Trainer.training_step`: the loss `compute_loss` returns (already scaled for gradient accumulation)
    is backpropagated and reported as is, on every release (decision 2)."""
    if _TRAINER_READS_LOSS_IS_SCALED_FOR_GA:
        yield
        return
    # Before 5.19 training_step skips its division when a `compute_loss_func` is set (it takes such a function's
    # loss to be scaled already); GRPOTrainer's compute_loss never calls one.
    saved = trainer.compute_loss_func
    trainer.compute_loss_func = _scaled_by_compute_loss
    try:
        yield
    finally:
        trainer.compute_loss_func = saved


def leave_accumulation_to_trainer(accelerator: Accelerator) -> None:
    """After the Trainer created its Accelerator: Accelerate does no gradient-accumulation scaling of its own (what
    transformers >= 5.6 sets up itself; decision 2). DeepSpeed reads the steps from its config and scales nothing
    here (the Trainer passes `scale_wrt_gas=False`)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED and accelerator.gradient_accumulation_steps != 1:
        accelerator.gradient_accumulation_steps = 1


def _scaled_by_compute_loss(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("GRPOTrainer computes its loss in compute_loss; compute_loss_func is not used.")


# ---------------------------------------------------------------------------------------------- 3. the cache


def cache_argument(lm: nn.Module) -> str:
    """The keyword under which `lm.forward` takes its KV cache (decision 3)."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"  # `cache`: 5.24


def has_linear_attention(config: PretrainedConfig) -> bool:
    """Whether the dynamic cache `generate` builds for `config` holds linear-attention (recurrent) layers."""
    return any(getattr(DynamicCache(config=config), "is_linear", ()))  # `is_linear`: transformers 5.13


# --------------------------------------------------------------------------------------- 4. continuous batching

CONTINUOUS_BATCHING_RELEASE = "5.9"


def continuous_batching_blocker() -> str | None:
    """Why transformers' continuous batching cannot be used with the installed release (None: it can)."""
    try:  # transformers 5.4: generate_batch(continuous_batching_config=...) with this configuration class
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None
    if ContinuousBatchingConfig is None or "seed" not in _fields(ContinuousBatchingConfig):  # `seed`: 5.9
        return (f"transformers' continuous batching (use_transformers_continuous_batching) needs transformers >= "
                f"{CONTINUOUS_BATCHING_RELEASE} (installed: {transformers.__version__})")
    return None


def _fields(cls: type) -> set[str]:
    return set(inspect.signature(cls).parameters)


# ------------------------------------------------------------------------------------------------- 5. replay

# transformers 5.2: outputs are recorded by hooks (`transformers.utils.output_capturing`), not by patched forwards.
LAYER_REPLAY = importlib.util.find_spec("transformers.utils.output_capturing") is not None
