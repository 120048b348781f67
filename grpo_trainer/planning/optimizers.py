"""What each optimizer of `TrainingArguments.optim` keeps per trained parameter, and what its step allocates on
top, as one table of same-signature functions (`OPTIMIZERS`).

Decisions:

1. State is what the optimizer keeps between steps: AdamW's two moments in the parameters' dtype (torch) or in
   8 / 4 bits (bitsandbytes, torchao), SGD's momentum buffer only with momentum > 0 (transformers' default is
   none), Adafactor's factored second moment (a row and a column per matrix, in float32).
2. The step's temporaries: torch's fused AdamW (transformers' default) writes in place; torch's unfused AdamW runs
   `foreach` on a GPU (one temporary as large as all trained parameters) and a per-tensor loop on CPU (two
   temporaries of the largest tensor); Adafactor squares each gradient into a temporary.
3. An optimizer this table does not know is counted as AdamW, and the plan says so (`known`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from grpo_trainer.planning.settings import ModelShape, PlanSettings

__all__ = ["OPTIMIZERS", "OptimizerMemory", "optimizer_memory"]


class OptimizerMemory(NamedTuple):
    state_bytes: int  # kept between steps, for `trainable` parameters
    step_bytes: int  # allocated during a step on top of the state
    known: bool = True


# (trainable parameters, bytes per parameter element, shape, settings) -> OptimizerMemory
OptimizerCost = Callable[[int, int, ModelShape, PlanSettings], OptimizerMemory]


def _per_parameter(state_bytes: float, trainable: int, element_bytes: int, shape: ModelShape,
                   settings: PlanSettings) -> OptimizerMemory:
    """A fixed number of state bytes per trained parameter; the step updates in place."""
    return OptimizerMemory(int(state_bytes * trainable), 0)


def _in_parameter_dtype(copies: int, trainable: int, element_bytes: int, shape: ModelShape,
                        settings: PlanSettings) -> OptimizerMemory:
    """`copies` buffers shaped like the parameters, in their dtype; the step updates in place (fused kernels)."""
    return OptimizerMemory(copies * trainable * element_bytes, 0)


def _adamw_torch(trainable: int, element_bytes: int, shape: ModelShape, settings: PlanSettings) -> OptimizerMemory:
    """torch's AdamW without `fused`: `foreach` on a GPU, a per-tensor loop on CPU (decision 2)."""
    largest = shape.largest_parameter if not shape.adapter_parameters else 0
    step = trainable * element_bytes if settings.device == "cuda" else 2 * largest * element_bytes
    return OptimizerMemory(2 * trainable * element_bytes, step)


def _sgd(trainable: int, element_bytes: int, shape: ModelShape, settings: PlanSettings) -> OptimizerMemory:
    return OptimizerMemory(trainable * element_bytes if settings.sgd_momentum > 0 else 0, 0)


def _adafactor(trainable: int, element_bytes: int, shape: ModelShape, settings: PlanSettings) -> OptimizerMemory:
    """A row and a column of float32 per matrix, a full float32 buffer per vector; a gradient squared per step."""
    largest = shape.largest_parameter if not shape.adapter_parameters else 0
    return OptimizerMemory(4 * shape.factored_state, 4 * largest)


OPTIMIZERS: dict[str, OptimizerCost] = {
    "adamw_torch_fused": functools.partial(_in_parameter_dtype, 2),
    "adamw_torch": _adamw_torch,
    "adamw_torch_xla": functools.partial(_in_parameter_dtype, 2),
    "adamw_torch_npu_fused": functools.partial(_in_parameter_dtype, 2),
    "adamw_anyprecision": functools.partial(_in_parameter_dtype, 2),
    "stable_adamw": functools.partial(_in_parameter_dtype, 2),
    "grokadamw": functools.partial(_in_parameter_dtype, 3),  # the moments and a slow gradient average
    "schedule_free_adamw": functools.partial(_in_parameter_dtype, 2),
    "schedule_free_radam": functools.partial(_in_parameter_dtype, 2),
    "schedule_free_sgd": functools.partial(_in_parameter_dtype, 1),
    "ademamix": functools.partial(_in_parameter_dtype, 3),
    "adamw_torch_8bit": functools.partial(_per_parameter, 2),
    "adamw_torch_4bit": functools.partial(_per_parameter, 1),
    "adamw_bnb_8bit": functools.partial(_per_parameter, 2),
    "adamw_8bit": functools.partial(_per_parameter, 2),
    "paged_adamw_8bit": functools.partial(_per_parameter, 2),
    "paged_adamw_32bit": functools.partial(_per_parameter, 8),
    "ademamix_8bit": functools.partial(_per_parameter, 3),
    "paged_ademamix_8bit": functools.partial(_per_parameter, 3),
    "paged_ademamix_32bit": functools.partial(_per_parameter, 12),
    "lion_8bit": functools.partial(_per_parameter, 1),
    "paged_lion_8bit": functools.partial(_per_parameter, 1),
    "lion_32bit": functools.partial(_per_parameter, 4),
    "paged_lion_32bit": functools.partial(_per_parameter, 4),
    "rmsprop": functools.partial(_in_parameter_dtype, 1),
    "rmsprop_bnb": functools.partial(_per_parameter, 4),
    "rmsprop_bnb_32bit": functools.partial(_per_parameter, 4),
    "rmsprop_bnb_8bit": functools.partial(_per_parameter, 1),
    "adagrad": functools.partial(_in_parameter_dtype, 1),
    "sgd": _sgd,
    "adafactor": _adafactor,
}


def optimizer_memory(trainable: int, element_bytes: int, shape: ModelShape, settings: PlanSettings
                     ) -> OptimizerMemory:
    """The optimizer's memory for `trainable` parameters of `element_bytes` each (decision 3 for unknown names)."""
    cost = OPTIMIZERS.get(settings.optimizer)
    if cost is None:
        return OPTIMIZERS["adamw_torch_fused"](trainable, element_bytes, shape, settings)._replace(known=False)
    return cost(trainable, element_bytes, shape, settings)
