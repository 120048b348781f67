"""Checks that reward functions, their weights and their processing classes line up, before any model is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["check_reward_setup"]


def check_reward_setup(reward_funcs: Sequence[Any], args: Any, reward_processing_classes: Any,
                       environment_rewards: int = 0) -> None:
    """Reward functions, their weights and processing classes must line up; `environment_rewards` counts the
    rewards environments own (`get_reward`), which need no reward function and take no weight."""
    if len(reward_funcs) + environment_rewards == 0:
        raise ValueError("No reward source provided. Pass `reward_funcs` (reward functions, reward models or model "
                         "ids), or an `environment_factory` whose environment defines a `get_reward` method.")
    for i, func in enumerate(reward_funcs):
        if not (callable(func) or isinstance(func, str)):
            raise ValueError(f"reward_funcs[{i}] is a {type(func).__name__}; each reward must be a callable, a "
                             "reward model (nn.Module) or a model id/path string.")
    if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(args.reward_weights)} entries but there are {len(reward_funcs)} "
                         "reward functions; give one weight per reward function.")
    if isinstance(reward_processing_classes, (list, tuple)) and len(reward_processing_classes) != len(reward_funcs):
        raise ValueError(f"reward_processing_classes has {len(reward_processing_classes)} entries but there are "
                         f"{len(reward_funcs)} reward functions; give one per reward function (None for callables).")
    if args.advantage_estimator == "rloo" and args.num_generations < 2:
        raise ValueError("advantage_estimator='rloo' needs num_generations >= 2: the leave-one-out baseline "
                         "averages the other completions of the prompt.")
