"""The health monitor's thresholds (`HealthSettings`, each default documented here and in docs/HEALTH.md) and the
run's settings its messages name (`RunFacts`).

A threshold is overridden by name through `GRPOConfig.health_thresholds` (a dict); `threshold_problems` is the check
`config.checks` runs on that dict, so a wrong name or value fails when the config is built, naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["HealthSettings", "RunFacts", "threshold_problems"]


@dataclass(frozen=True)
class HealthSettings:
    """When each diagnosis sets in; it clears once its metric is back past `hysteresis` x the threshold (above it
    for the lower bounds) for `recovery` log steps."""

    patience: int = 2  # log steps (that carry the metric) a condition must hold before it is diagnosed
    recovery: int = 3  # log steps it must be gone before the diagnosis clears
    hysteresis: float = 0.8  # clear level = threshold x this (upper bounds) or threshold / this (lower bounds)
    truncated_fraction: float = 0.5  # completions/clipped_ratio: share cut at max_completion_length without EOS
    # ...when the cut ones score this many reward standard deviations below the finished ones (the gap metric), or
    # most groups carry no signal (zero_variance_fraction)
    truncation_gap: float = 0.25
    zero_variance_fraction: float = 0.75  # frac_reward_zero_std: share of completions in groups of equal rewards
    saturated_std: float = 1e-6  # rewards/<f>/std at or below this (x max(1, |mean|)): the function is constant
    missing_fraction: float = 0.5  # rewards/<f>/missing: share of completions a function returned None for or failed
    dominant_share: float = 0.9  # one function's share of the weighted reward spread (|weight| x std), weights unequal
    entropy_floor: float = 0.05  # entropy (nats per token) at or below this while most groups carry no signal
    kl_growth_factor: float = 2.0  # kl: the mean of the last trend_window log steps over the window before ...
    kl_growth_per_step: float = 0.05  # ... and the rise per optimizer step (nats per token)
    clipped_fraction: float = 0.2  # clip_ratio/region_mean: share of tokens whose ratio the clip holds
    ess_fraction: float = 0.5  # importance weights' effective sample size / tokens at or below this
    grad_spike_factor: float = 10.0  # grad_norm over this x the median of the previous log steps and x max_grad_norm
    nonfinite_steps: float = 1.0  # nonfinite_steps (micro-steps dropped since the last log) at or above this
    trend_window: int = 3  # log steps per window of the KL trend; the grad-norm median takes 3 windows
    # The task counts as learned (no zero-variance, saturation or entropy diagnosis) once the reward has risen above
    # its first value by this many reward stds (the round's now or at the first log step, the larger) and is within
    # learned_margin of the range it covered from its best.
    learned_rise: float = 3.0
    learned_margin: float = 0.1

    @classmethod
    def of(cls, overrides: dict[str, Any] | None) -> HealthSettings:
        """The defaults with `overrides` (checked first by `threshold_problems`)."""
        return dataclasses.replace(cls(), **(overrides or {}))


_COUNTS = ("patience", "recovery", "trend_window")
_FRACTIONS = ("hysteresis", "truncated_fraction", "zero_variance_fraction", "missing_fraction", "dominant_share",
              "clipped_fraction", "ess_fraction", "learned_margin")


def threshold_problems(overrides: Any) -> list[str]:
    """What is wrong with `overrides` (GRPOConfig.health_thresholds): each message names the field and the fix."""
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        return [f"health_thresholds must be a dict of threshold name -> number (got {type(overrides).__name__})."]
    known = [f.name for f in dataclasses.fields(HealthSettings)]
    problems = []
    for name, value in overrides.items():
        if name not in known:
            problems.append(f"health_thresholds has an unknown threshold {name!r}; choose from {known} "
                            "(docs/HEALTH.md).")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"health_thresholds[{name!r}] must be a finite number (got {value!r}).")
        elif name in _COUNTS and (value < 1 or value != int(value)):
            problems.append(f"health_thresholds[{name!r}] must be a whole number >= 1 (got {value!r}).")
        elif name in _FRACTIONS and not 0 < value <= 1:
            problems.append(f"health_thresholds[{name!r}] must be in (0, 1] (got {value!r}).")
        elif value < 0:
            problems.append(f"health_thresholds[{name!r}] must be >= 0 (got {value!r}).")
    return problems


@dataclass(frozen=True)
class RunFacts:
    """The run's settings that the rules read (reward weights, the clip) and that the fixes name. None: unknown
    (a log read back without them)."""

    max_completion_length: int | None = None
    num_generations: int | None = None
    learning_rate: float | None = None
    beta: float | None = None
    epsilon: float | None = None
    num_iterations: int | None = None
    max_grad_norm: float | None = None
    zero_variance_groups: str | None = None
    reward_error_policy: str | None = None
    reward_names: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None
    multi_objective_aggregation: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunFacts:
        """Facts written by `as_dict` (a summary record); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
        return cls(**kept)

    def weight(self, name: str) -> float:
        """The reward function's weight (1.0 when unknown)."""
        if self.reward_weights is None or name not in self.reward_names:
            return 1.0
        return float(self.reward_weights[self.reward_names.index(name)])
