"""The choice fields of `GRPOConfig` as `Literal` types: one source for the field's annotation (which
`HfArgumentParser` turns into the command line's `choices`) and for the check that refuses any other value
(`config.checks`). Choices that an algorithm's registry defines are read from that registry.

Not here, on purpose: fields whose registry users extend at run time (`advantage_estimator`, `generation_backend`)
and `scale_rewards`, which TRL also accepts as a bool.
"""

from __future__ import annotations

from typing import Literal, get_args

from grpo_trainer.algorithms.advantage import MULTI_OBJECTIVE_AGGREGATIONS
from grpo_trainer.algorithms.engine_correction import IS_MODES
from grpo_trainer.algorithms.losses import LOSS_TYPES

__all__ = ["AsyncCorrection", "ImportanceSamplingLevel", "LossType", "MemoryCheck", "MultiObjectiveAggregation",
           "RewardErrorPolicy", "RoutingReplay", "VLLMImportanceSamplingMode", "VLLMMode", "VLLMModelImpl",
           "ZeroVarianceGroups", "choices"]

LossType = Literal[tuple(LOSS_TYPES)]
ImportanceSamplingLevel = Literal["token", "sequence"]
MultiObjectiveAggregation = Literal[tuple(MULTI_OBJECTIVE_AGGREGATIONS)]
RewardErrorPolicy = Literal["raise", "none"]
ZeroVarianceGroups = Literal["train", "skip", "resample"]
MemoryCheck = Literal["auto", "error", "warn", "off"]
AsyncCorrection = Literal["behaviour", "recompute"]
VLLMMode = Literal["colocate", "server"]
VLLMModelImpl = Literal["vllm", "transformers"]
VLLMImportanceSamplingMode = Literal[IS_MODES]
RoutingReplay = Literal["auto", "on", "off"]


def choices(kind: object) -> tuple[str, ...]:
    """The values a `Literal` choice type admits, in its order."""
    return get_args(kind)
