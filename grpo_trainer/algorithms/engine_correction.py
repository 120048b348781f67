"""Importance-sampling correction for an inference engine's sampler (vLLM): pure tensor functions.

An inference engine samples with its own kernels, so the probability it gave a token differs from the trainer's at
the same weights (truncated importance sampling, Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"). Each completion token is weighted by rho = pi_old / pi_engine, the trainer's probability
at the sampling weights over the engine's, bounded to keep the variance in check. TRL 1.16 calls this
`vllm_importance_sampling_correction`; its four modes and its metrics are reproduced here.

Decisions:

1. In this correction the engine's log-probs never stand in for the trainer's (`old_logps`): they only enter
   through rho. (Elsewhere they also feed the off-policy mask and the mismatch report, and a round sampled ahead with
   `async_correction='behaviour'` takes them as its old log-probs: `trainer.off_policy`.)
2. A token the engine could not score (NaN) gets a log-ratio of 0 (rho = 1, no correction), as do padding tokens.
3. Modes: `token_*` one rho per token `[B, T]`; `sequence_*` one per completion `[B, 1]`, the exponential of the
   summed token log-ratios. `*_truncate` clamps rho to [clip_min, clip_max]; `*_mask` sets rho to 0 outside it (the
   token or completion then trains on nothing). A None bound is no bound.
4. Metrics, under TRL's names: the mean and max of |log pi_old - log pi_engine| over the completion tokens both
   scored, and the min, mean and max of rho over completion tokens (`token_*`) or completions (`sequence_*`); each
   is 0 when there is nothing to measure, as in TRL. `CROSS_PROCESS` says how each process's value is reduced.

Shapes: `B` completions, `T` completion tokens. Masks are 0/1 `[B, T]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CROSS_PROCESS", "IS_MODES", "EngineCorrection", "engine_importance_ratio", "engine_log_ratio",
           "engine_mismatch_metrics"]

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class EngineCorrection:
    """The correction's settings (TRL's `vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0


def _is_sequence_mode(mode: str) -> bool:
    if mode not in IS_MODES:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}; choose one of {IS_MODES}.")
    return mode.startswith("sequence_")


def engine_log_ratio(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, mode: str) -> Tensor:
    """log rho = log pi_old - log pi_engine per token `[B, T]` (`token_*` modes) or summed per completion `[B, 1]`
    (`sequence_*` modes); 0 on padding and where the engine's value is NaN (decision 2)."""
    diff = torch.nan_to_num((old_logps - engine_logps) * mask, nan=0.0)  # [B, T]
    return diff.sum(-1, keepdim=True) if _is_sequence_mode(mode) else diff


def engine_importance_ratio(old_logps: Tensor, engine_logps: Tensor, mask: Tensor, mode: str,
                            clip_min: float | None, clip_max: float | None) -> Tensor:
    """The bounded importance weight rho `[B, T]` or `[B, 1]` (decision 3). Not differentiated: it only rescales
    each token's loss."""
    with torch.no_grad():
        ratio = torch.exp(engine_log_ratio(old_logps, engine_logps, mask, mode))
        if mode.endswith("_truncate"):
            return torch.clamp(ratio, min=clip_min, max=clip_max)
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _or_zero(values: Tensor, reduce: Callable[[Tensor], Tensor]) -> Tensor:
    return reduce(values) if values.numel() else values.new_zeros(())


def engine_mismatch_metrics(old_logps: Tensor, engine_logps: Tensor, ratio: Tensor, mask: Tensor,
                            mode: str) -> dict[str, Tensor]:
    """This process's values of TRL's sampling metrics (decision 4): `ratio` is `engine_importance_ratio`'s output
    for the same inputs. Reduce each across processes with `CROSS_PROCESS`."""
    scored = mask.bool()
    delta = (old_logps - engine_logps).abs()
    delta = delta[scored & ~torch.isnan(delta)]
    ratios = ratio.flatten() if _is_sequence_mode(mode) else ratio[scored]
    return {
        "sampling/sampling_logp_difference/mean": _or_zero(delta, torch.mean),
        "sampling/sampling_logp_difference/max": _or_zero(delta, torch.max),
        "sampling/importance_sampling_ratio/min": _or_zero(ratios, torch.min),
        "sampling/importance_sampling_ratio/mean": _or_zero(ratios, torch.mean),
        "sampling/importance_sampling_ratio/max": _or_zero(ratios, torch.max),
    }


def _nanmin(x: Tensor) -> Tensor:
    return torch.where(torch.isnan(x), math.inf, x).min() if not torch.isnan(x).all() else x.new_full((), math.nan)


def _nanmax(x: Tensor) -> Tensor:
    return -_nanmin(-x)


# metric -> how the values `[N]` of N processes become one (TRL: mean/max of the differences, nan-aware
# min/mean/max of the ratios).
CROSS_PROCESS: dict[str, Callable[[Tensor], Tensor]] = {
    "sampling/sampling_logp_difference/mean": torch.mean,
    "sampling/sampling_logp_difference/max": torch.max,
    "sampling/importance_sampling_ratio/min": _nanmin,
    "sampling/importance_sampling_ratio/mean": torch.nanmean,
    "sampling/importance_sampling_ratio/max": _nanmax,
}
