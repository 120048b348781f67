"""Metrics under TRL's names: what a generation round reports, and the mean of a logging window.

Values stay tensors (or floats) until the logging step, where one collective averages every metric over the
processes: no host sync per micro-step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpo_trainer.algorithms.advantage import group_std

__all__ = ["pass_at_k", "rollout_metrics", "tool_metrics", "window_means"]


def _nanstd(x: Tensor) -> Tensor:
    valid = x[~torch.isnan(x)]
    return valid.std() if valid.numel() > 1 else x.new_zeros(())


def rollout_metrics(lengths: Tensor, truncated: Tensor, rewards: Tensor, weights: Tensor, num_generations: int,
                    reward_names: Sequence[str], with_pass_at_k: bool = False) -> dict[str, Tensor | float]:
    """One round's metrics, from values gathered over all processes.

    Args: lengths `[B]` completion tokens (EOS included), truncated `[B]` 0/1, rewards `[B, F]` (NaN = missing),
    weights `[F]`; B is the global round size, in contiguous groups of `num_generations`.
    """
    total = torch.nansum(rewards * weights.to(rewards), dim=1)  # [B]
    stds = group_std(total.cpu(), num_generations)  # [P]
    terminated = lengths[truncated == 0].float()
    out: dict[str, Tensor | float] = {
        "completions/mean_length": lengths.float().mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.float().mean(),
        "completions/mean_terminated_length": terminated.mean() if terminated.numel() else 0.0,
        "reward": total.mean(),
        "reward_std": torch.nanmean(stds),
        "frac_reward_zero_std": (torch.nan_to_num(stds, nan=0.0) < 1e-6).float().mean(),
    }
    for i, name in enumerate(reward_names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, i])
        out[f"rewards/{name}/std"] = _nanstd(rewards[:, i])
    if with_pass_at_k:
        out.update(pass_at_k(total.cpu(), num_generations))
    return out


def tool_metrics(calls: Tensor, failures: Tensor, rollouts: Tensor) -> dict[str, Tensor]:
    """TRL's tool metrics of a round, from counts summed over processes: tool calls per rollout, and the fraction
    of calls that failed (0 without calls)."""
    return {"tools/call_frequency": calls / rollouts,
            "tools/failure_frequency": failures / calls if calls > 0 else torch.zeros_like(calls, dtype=torch.float)}


def window_means(window: dict[str, list]) -> tuple[list[str], Tensor]:
    """Sorted metric names and the NaN-ignoring mean of each over the window, as one `[K]` tensor to reduce."""
    keys = sorted(window)
    means = []
    for key in keys:
        finite = [float(v) for v in window[key] if not math.isnan(float(v))]
        means.append(sum(finite) / len(finite) if finite else math.nan)
    return keys, torch.tensor(means)


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
