"""Metrics under TRL 1.16's names and with its semantics: what a generation round reports, and the mean of a logging
window.

Decisions:

1. Round metrics are computed from values gathered over every process, so each process records the same numbers.
2. `reward` is the mean over completions of the weighted sum of the reward functions that scored them (None skipped,
   as `nansum`); a completion that no function scored is left out of `reward` and `reward_std`, as it is left out of
   the advantage baselines (`algorithms.advantage.as_reward_vector` is the one definition of that sum).
3. `reward_std` is the std of that sum over the whole round, not a mean of group stds. `frac_reward_zero_std` is the
   share of completions whose advantage scale is 0 under `scale_rewards`: the group's std for 'group' and 'none',
   the round's std for 'batch'. A group with fewer than two scored completions has a NaN std, which is not zero.
4. A window's mean skips NaN values (a reward function that abstained on a whole round); a metric with no value
   left logs None, as TRL does. Each process sends (sum, count) pairs, so one collective sums them.
5. Values stay tensors (or floats) until the logging step: no host sync per micro-step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_trainer.algorithms.advantage import as_reward_vector, group_std, nanstd

__all__ = ["MetricsWindow", "StepTime", "completion_length_metrics", "pass_at_k", "resample_metrics", "reward_metrics",
           "tool_metrics", "window_means", "window_totals", "zero_std_fraction"]


def completion_length_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, Tensor]:
    """Length statistics of one round. lengths `[B]` completion tokens (EOS included), truncated `[B]` (nonzero: the
    completion hit `max_completion_length` without an EOS). With no terminated completion, the terminated
    statistics are 0, as TRL reports them."""
    lengths = lengths.float()
    terminated = lengths[truncated == 0]
    if terminated.numel() == 0:
        terminated = lengths.new_zeros(1)
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": (truncated != 0).float().mean(),
        "completions/mean_terminated_length": terminated.mean(),
        "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }


def zero_std_fraction(total: Tensor, num_generations: int, scale: str) -> Tensor:
    """Share of completions whose reward std (the advantage's scale, see decision 3) is 0.

    total `[B]` combined rewards (NaN: unscored) in contiguous groups of `num_generations`. A single completion
    (G = 1, or a round of one for 'batch') has std 0 by convention, as in TRL.
    """
    if scale == "batch":
        std = nanstd(total) if total.numel() > 1 else total.new_zeros(())
    else:
        std = group_std(total, num_generations) if num_generations > 1 else total.new_zeros(total.numel())
    # |std| <= 1e-8, torch.isclose's tolerance against 0; NaN compares unequal
    return torch.isclose(std, torch.zeros_like(std)).float().mean()


def reward_metrics(rewards: Tensor, weights: Tensor, reward_names: Sequence[str], num_generations: int,
                   scale: str, with_pass_at_k: bool = False) -> dict[str, Tensor | float]:
    """Reward statistics of one round. rewards `[B, F]` (NaN: the function returned None), weights `[F]`;
    `with_pass_at_k` adds pass@k when the combined rewards are all 0 or 1."""
    total = as_reward_vector(rewards, weights)  # [B], NaN where no function scored
    out: dict[str, Tensor | float] = {
        "reward": torch.nanmean(total),
        "reward_std": nanstd(total),
        "frac_reward_zero_std": zero_std_fraction(total, num_generations, scale),
    }
    for i, name in enumerate(reward_names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, i])
        out[f"rewards/{name}/std"] = nanstd(rewards[:, i])
    if with_pass_at_k:
        out.update(pass_at_k(total.cpu(), num_generations))
    return out


def resample_metrics(extra_rounds: int, prompts_generated: int, zero_variance_fraction: float,
                     kept_zero_variance: int) -> dict[str, float]:
    """Dynamic sampling's statistics of one round (`trainer.resample`): extra generation rounds, prompts generated
    (the round's own included), the share of every generated group whose rewards were all equal, and the groups
    trained on although their rewards were equal (the extra rounds ran out)."""
    return {"zero_variance_groups/extra_rounds": float(extra_rounds),
            "zero_variance_groups/prompts_generated": float(prompts_generated),
            "zero_variance_groups/fraction": float(zero_variance_fraction),
            "zero_variance_groups/kept": float(kept_zero_variance)}


def tool_metrics(calls: Tensor, failures: Tensor, rollouts: Tensor) -> dict[str, Tensor]:
    """TRL's tool metrics of a round, from counts summed over processes: tool calls per rollout, and the fraction
    of calls that failed (0 without calls)."""
    return {"tools/call_frequency": calls / rollouts,
            "tools/failure_frequency": failures / calls if calls > 0 else torch.zeros_like(calls, dtype=torch.float)}


class MetricsWindow:
    """Each mode's metric values since the last log (`windows` is TRL's `trainer._metrics`: mode -> name -> values)."""

    def __init__(self) -> None:
        self.windows: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        # logged as the window's extreme over every process: the largest value, or with `add_min` (stored negated)
        # the smallest
        self.maxima: dict[str, dict[str, float]] = {"train": {}, "eval": {}}
        self.negated: set[str] = set()

    def __getitem__(self, mode: str) -> dict[str, list]:
        return self.windows[mode]

    def replace(self, windows: dict[str, dict[str, list]]) -> None:
        """`windows` in place of the current ones (TRL's `trainer._metrics = {...}`, which TRL's tests and users'
        callbacks assign): each mode's values as a default-list mapping, as `add` needs, and both modes present. A
        `defaultdict` given is kept as it is, so the caller's later appends land in the window."""
        given = {mode: values if isinstance(values, defaultdict) else defaultdict(list, values)
                 for mode, values in windows.items()}
        self.windows = {"train": defaultdict(list), "eval": defaultdict(list), **given}

    def add(self, mode: str, key: str, value: Any) -> None:
        self.windows[mode][key].append(value)

    def set(self, mode: str, key: str, value: Any) -> None:
        """A running total's latest value (logged as is, not averaged over the window)."""
        self.windows[mode][key] = [value]

    def add_max(self, mode: str, key: str, value: float) -> None:
        """A value whose window maximum (over every process) is logged."""
        self.maxima[mode][key] = max(float(value), self.maxima[mode].get(key, -math.inf))

    def add_min(self, mode: str, key: str, value: float) -> None:
        """A value whose window minimum (over every process) is logged."""
        self.negated.add(key)
        self.add_max(mode, key, -float(value))

    def extremes(self, mode: str, reduce_max: Any) -> dict[str, float]:
        """Each extreme's value over the window and every process; `reduce_max`: a `[K]` tensor's element-wise
        maximum over processes."""
        maxima = self.maxima[mode]
        if not maxima:
            return {}
        largest = reduce_max(torch.tensor(list(maxima.values()), dtype=torch.float64)).tolist()
        return {key: -value if key in self.negated else value for key, value in zip(maxima, largest)}

    def clear(self, mode: str) -> None:
        self.windows[mode].clear()
        self.maxima[mode].clear()

    def reduced(self, mode: str, reduce: Callable[[Tensor, str], Tensor], device: torch.device) -> dict[str, Any]:
        """The window's values to log, over every process: each metric's mean (`window_totals` summed), then each
        extreme. `reduce(tensor, "sum" | "max")`: accelerate's reduction over processes. Every process must call
        this at the same log step, with the same keys."""
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        keys, local = window_totals(self.windows[mode])
        local = local.to(device, dtype)
        logs: dict[str, Any] = dict(window_means(keys, reduce(local, "sum").cpu() if keys else local))
        logs.update(self.extremes(mode, lambda values: reduce(values.to(device, dtype), "max").cpu()))
        return logs


class StepTime:
    """TRL's `step_time` metric: seconds spent in `training_step` over the micro-steps of one optimizer step."""

    def __init__(self, metrics: MetricsWindow) -> None:
        self.metrics, self.seconds, self.micro_steps = metrics, 0.0, 0

    @contextlib.contextmanager
    def micro_step(self, accumulation_steps: int) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - started
        self.micro_steps += 1
        if self.micro_steps >= accumulation_steps:
            self.metrics.add("train", "step_time", self.seconds)
            self.seconds, self.micro_steps = 0.0, 0


def window_totals(window: dict[str, list]) -> tuple[list[str], Tensor]:
    """Sorted metric names and, for each, the sum and the count of its non-NaN values in the window: `[K, 2]`
    float64, to be summed over processes."""
    keys = sorted(window)
    totals = []
    for key in keys:
        values = [float(v) for v in window[key]]
        finite = [v for v in values if not math.isnan(v)]
        totals.append([sum(finite), len(finite)])
    return keys, torch.tensor(totals, dtype=torch.float64).reshape(len(keys), 2)


def window_means(keys: Sequence[str], totals: Tensor) -> dict[str, float | None]:
    """Each metric's mean from its (sum, count) `[K, 2]`; None for a metric with no non-NaN value."""
    return {key: (total / count if count else None) for key, (total, count) in zip(keys, totals.tolist())}


def pass_at_k(rewards: Tensor, num_generations: int) -> dict[str, float]:
    """Unbiased pass@k (Chen et al. 2021) for binary rewards, k = 1, 2, 4, ... up to G.

    rewards `[B]` in contiguous groups of G; a group with c correct of n samples has
    pass@k = 1 - C(n-c, k) / C(n, k). Returns {} when the rewards are not all 0 or 1.
    """
    if not bool(((rewards == 0) | (rewards == 1)).all()):
        return {}
    correct = rewards.view(-1, num_generations).sum(1).long().tolist()
    n = num_generations
    ks = sorted({k for k in (2 ** i for i in range(n.bit_length())) if k <= n} | {n})
    return {f"pass@{k}": sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in correct) / len(correct)
            for k in ks}
