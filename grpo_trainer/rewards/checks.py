"""Checks that reward functions, their weights and their processing classes line up, before any model is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["as_processing_classes", "check_reward_setup"]


def as_processing_classes(reward_processing_classes: Any, count: int) -> list:
    """`reward_processing_classes` as a list: None means one None per reward; a single tokenizer is a list of one
    (so it must pair with a single reward, as in TRL)."""
    if reward_processing_classes is None:
        return [None] * count
    if isinstance(reward_processing_classes, (list, tuple)):
        return list(reward_processing_classes)
    return [reward_processing_classes]


def check_reward_setup(reward_funcs: Sequence[Any], reward_weights: Sequence[float] | None,
                       reward_processing_classes: Any, environment_rewards: int = 0) -> None:
    """Reward functions, their weights and processing classes must line up; `environment_rewards` counts the
    rewards environments own (`get_reward`), which need no reward function and take no weight."""
    if len(reward_funcs) + environment_rewards == 0:
        raise ValueError("No reward source provided. Pass `reward_funcs` (one or more reward functions, reward models "
                         "or reward model ids/paths), or an `environment_factory` whose environment defines a "
                         "`get_reward` method.")
    for i, func in enumerate(reward_funcs):
        if not (callable(func) or isinstance(func, str)):
            raise ValueError(f"reward_funcs[{i}] is a {type(func).__name__}; each reward must be a callable, a "
                             "reward model (nn.Module) or a model id/path string.")
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(reward_weights)} entries but there are {len(reward_funcs)} "
                         "reward functions; give one weight per reward function.")
    processing_classes = as_processing_classes(reward_processing_classes, len(reward_funcs))
    if len(processing_classes) != len(reward_funcs):
        raise ValueError(f"The number of reward processing classes ({len(processing_classes)}) must match the number "
                         f"of reward functions ({len(reward_funcs)}): give a list with one per reward function (None "
                         "for reward functions and for reward models that load their own tokenizer).")
