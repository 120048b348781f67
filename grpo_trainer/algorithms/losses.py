"""The per-token policy objective and its reduction: pure tensor functions, no `.item()`, no model.

Decisions:

1. Loss = surrogate (how one token is scored, `surrogates`) then aggregation (how token losses become one number)
   + beta * KL, - c * entropy. TRL's `loss_type` names pick surrogate and aggregation at once (`grpo`, `bnpo`,
   `dr_grpo`, `dapo`, `luspo` share the clipped surrogate and differ in aggregation; `cispo`, `sapo`, `vespo`
   change the surrogate); `LOSS_TYPES` maps each name to its pair.
2. Every aggregation already includes gradient-accumulation scaling, so the trainer sets
   `loss_is_scaled_for_ga = True`. Summing a window's micro-batch losses and averaging over processes (what
   DDP/DeepSpeed do to gradients) gives the documented quantity; `dapo` is then the token mean over the whole
   accumulated global batch, independent of how it was split (DAPO, arXiv:2503.14476, section 3.3).
3. On-policy (no `old_logps`), the ratio is `exp(logp - logp.detach())`: 1 in value, grad of log pi in gradient.
4. The off-policy and high-entropy masks (`masks`) multiply the surrogate only, before the KL term is added; every
   normaliser and metric still counts all completion tokens, as in TRL. The entropy bonus (`entropy`) is the
   mean entropy over the tokens the surrogate trains on.
5. Metrics follow TRL's names and definitions: a `[B, T]` quantity is averaged over completion tokens, a `[B, 1]`
   one (sequence level) over completions; `clip_ratio/low_min` and `clip_ratio/high_max` are the extremes over
   completions, returned per completion (`LossOutput.per_sequence`) for the trainer to reduce across processes
   with `SEQUENCE_METRICS`.

Shapes: `B` completions in the micro-batch, `T` completion tokens. Masks are 0/1 float or bool `[B, T]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from grpo_trainer.algorithms.entropy import entropy_bonus
from grpo_trainer.algorithms.masks import off_policy_mask
from grpo_trainer.algorithms.surrogates import (
    SURROGATES,
    SurrogateParams,
    cispo_surrogate,
    clipped_surrogate,
    sapo_surrogate,
    vespo_surrogate,
)

__all__ = [
    "AGGREGATIONS",
    "LOSS_TYPES",
    "LossBatch",
    "LossSettings",
    "SEQUENCE_METRICS",
    "SURROGATES",
    "LossNorm",
    "LossOutput",
    "SurrogateParams",
    "cispo_surrogate",
    "clipped_surrogate",
    "kl_k3",
    "log_importance_ratio",
    "nanmax",
    "nanmin",
    "objective_loss",
    "policy_loss",
    "sapo_surrogate",
    "vespo_surrogate",
]

ImportanceLevel = Literal["token", "sequence"]


class LossNorm(NamedTuple):
    """Counts the aggregations divide by, fixed for one gradient-accumulation window on one process.

    Attributes:
        accumulation_steps: micro-batches in the window (gradient accumulation steps).
        window_tokens: active completion tokens in the window summed over all processes, divided by the
            number of processes (the `dapo`/`cispo`/`vespo` normaliser).
        max_completion_length: the `dr_grpo` constant normaliser.
    """

    accumulation_steps: int = 1
    window_tokens: float | Tensor = 1.0
    max_completion_length: int = 1


class LossOutput(NamedTuple):
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor]  # detached scalars; reduced and `.item()`-ed by the trainer at logging time
    per_sequence: dict[str, Tensor]  # [B] values (NaN for an empty completion), reduced by `SEQUENCE_METRICS`


def log_importance_ratio(logps: Tensor, old_logps: Tensor | None, mask: Tensor, level: ImportanceLevel) -> Tensor:
    """log(pi_theta / pi_old) per token `[B, T]`, or per sequence `[B, 1]` (GSPO, arXiv:2507.18071: the mean
    of the token log-ratios, i.e. the log of the length-normalised sequence ratio)."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(logps.dtype)
        return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence'; got {level!r}.")


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(r) - r - 1 with r = ref - logp.
    Non-negative, 0 where the two agree, unbiased under samples from pi_theta."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1.0


def _sequence_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`grpo`, `sapo`: each sequence's token mean, then the mean over sequences (the original GRPO objective)."""
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean() / norm.accumulation_steps


def _sequence_sum(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`luspo` (arXiv:2602.05261): each sequence's token sum, then the mean over sequences, so a sequence weighs
    as much as it is long (GSPO's sequence mean made length-unbiased)."""
    return (loss * mask).sum(-1).mean() / norm.accumulation_steps


def _batch_token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`bnpo`: token mean over the local micro-batch."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0) / norm.accumulation_steps


def _constant_length(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`dr_grpo` (arXiv:2503.20783): token sum over a constant, B * max_completion_length, so length does not
    change a token's weight."""
    return (loss * mask).sum() / (loss.shape[0] * norm.max_completion_length) / norm.accumulation_steps


def _global_token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`dapo`, `cispo`, `vespo`: token sum over the window's average active tokens per process; summed over
    micro-batches and averaged over processes this is the token mean of the whole accumulated global batch."""
    return (loss * mask).sum() / torch.as_tensor(norm.window_tokens, dtype=loss.dtype).clamp(min=1.0)


Aggregation = Callable[[Tensor, Tensor, LossNorm], Tensor]

AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": _sequence_mean,
    "luspo": _sequence_sum,
    "bnpo": _batch_token_mean,
    "dr_grpo": _constant_length,
    "dapo": _global_token_mean,
}
# loss_type -> (surrogate, aggregation), the two axes TRL's single name packs together.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "grpo"),
    "bnpo": ("clip", "bnpo"),
    "dr_grpo": ("clip", "dr_grpo"),
    "dapo": ("clip", "dapo"),
    "luspo": ("clip", "luspo"),
    "cispo": ("cispo", "dapo"),
    "sapo": ("sapo", "grpo"),
    "vespo": ("vespo", "dapo"),
}


def nanmin(x: Tensor) -> Tensor:
    """The smallest non-NaN value of `x`, NaN if there is none (no host sync)."""
    missing = torch.isnan(x)
    return torch.where(missing.all(), math.nan, torch.where(missing, math.inf, x).amin())


def nanmax(x: Tensor) -> Tensor:
    """The largest non-NaN value of `x`, NaN if there is none (no host sync)."""
    return -nanmin(-x)


# Per-completion metric -> (the surrogate metric whose per-completion mean it takes, its reduction over all
# completions of every process). TRL logs these for the clipped surrogate.
SEQUENCE_METRICS: dict[str, tuple[str, Callable[[Tensor], Tensor]]] = {
    "clip_ratio/low_min": ("clip_ratio/low_mean", nanmin),
    "clip_ratio/high_max": ("clip_ratio/high_mean", nanmax),
}


_DEFAULT_PARAMS = SurrogateParams()


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _metric_mean(x: Tensor, mask: Tensor) -> Tensor:
    """A metric's value on this micro-batch: the mean over completions of a `[B, 1]` quantity, over completion tokens
    of a `[B, T]` one (TRL's definition)."""
    x = x.detach().to(mask.dtype)
    return x.mean() if x.shape[-1] == 1 else _masked_mean(x, mask)


def _per_sequence(x: Tensor, mask: Tensor) -> Tensor:
    """`[B]`: a `[B, 1]` quantity as is, a `[B, T]` one averaged over each completion's tokens (NaN if it has none)."""
    x = x.detach().to(mask.dtype)
    return x.squeeze(-1) if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


@dataclass(frozen=True)
class LossSettings:
    """The objective's fixed choices for a run (built once from the config; `policy_loss`'s keyword arguments)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    kl_bias_correction: bool = False
    params: SurrogateParams = _DEFAULT_PARAMS
    importance_sampling_level: ImportanceLevel = "token"
    off_policy_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {sorted(LOSS_TYPES)}.")


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's tensors the objective reads besides the current log-probs (shapes as in `policy_loss`)."""

    advantages: Tensor  # [B] or [B, T]
    mask: Tensor  # [B, T]
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    sampling_logps: Tensor | None = None
    engine_ratio: Tensor | None = None
    entropy_mask: Tensor | None = None
    entropy: Tensor | None = None
    entropy_coef: float | None = None


def policy_loss(
    logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    norm: LossNorm,
    *,
    loss_type: str = "dapo",
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    kl_bias_correction: bool = False,
    params: SurrogateParams = _DEFAULT_PARAMS,
    importance_sampling_level: ImportanceLevel = "token",
    off_policy_threshold: float | None = None,
    sampling_logps: Tensor | None = None,
    entropy_mask: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float | None = None,
    engine_ratio: Tensor | None = None,
) -> LossOutput:
    """`objective_loss` with its settings and tensors given as keywords (the form the algorithm tests use)."""
    settings = LossSettings(loss_type, beta, kl_bias_correction, params, importance_sampling_level,
                            off_policy_threshold)
    batch = LossBatch(advantages, mask, old_logps, ref_logps, sampling_logps, engine_ratio, entropy_mask, entropy,
                      entropy_coef)
    return objective_loss(logps, batch, settings, norm)


def objective_loss(logps: Tensor, batch: LossBatch, settings: LossSettings, norm: LossNorm) -> LossOutput:
    """The GRPO objective for one micro-batch.

    Args:
        logps: `[B, T]` log pi_theta of the completion tokens (differentiable).
        batch.advantages: `[B]` (one per completion) or `[B, T]`.
        batch.mask: `[B, T]` 1 for completion tokens in the loss.
        batch.old_logps / batch.ref_logps: `[B, T]` or None (on-policy / no KL term).
        settings.kl_bias_correction: multiply each token's KL by the (differentiable) importance ratio rho, token- or
            sequence-level as `importance_sampling_level` says (DeepSeek-V3.2, arXiv:2512.02556): the KL term's
            gradient becomes the unbiased reverse-KL gradient under samples from pi_old. On-policy rho is 1 in
            value, so only the gradient changes: d(rho * k3)/d logp = k3 + d k3/d logp.
        settings.params: the surrogates' hyperparameters.
        settings.off_policy_threshold: drop negative-advantage completions that drifted further than this from the
            sampling policy (`masks.off_policy_mask`); `batch.sampling_logps` `[B, T]` are that policy's log-probs
            (default: `old_logps`, else the current ones, detached).
        batch.entropy_mask: `[B, T]` the high-entropy tokens (`masks.high_entropy_mask`); the surrogate trains on them
            only.
        batch.entropy / batch.entropy_coef: `[B, T]` differentiable per-token entropy and the bonus coefficient; with
            a coefficient (0 included) the loss gets - c * `entropy.entropy_bonus` and the metric `policy_loss`.
        batch.engine_ratio: `[B, T]` an inference engine's importance weight (`engine_correction`), applied by the
            surrogate (`surrogates`, decision 3); the KL term is not weighted, as in TRL.
    Returns: the loss; detached metrics under TRL's names (`kl`, the surrogate's, `policy_loss`); and per-completion
    values for `SEQUENCE_METRICS`.
    """
    advantages, old_logps, ref_logps = batch.advantages, batch.old_logps, batch.ref_logps
    entropy_mask, entropy, entropy_coef = batch.entropy_mask, batch.entropy, batch.entropy_coef
    level, params, beta = settings.importance_sampling_level, settings.params, settings.beta
    surrogate_name, aggregation_name = LOSS_TYPES[settings.loss_type]
    mask = batch.mask.to(logps.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    token_log_ratio = log_importance_ratio(logps, old_logps, mask, "token")
    log_ratio = log_importance_ratio(logps, old_logps, mask, level)
    per_token, flags = SURROGATES[surrogate_name](log_ratio, token_log_ratio, adv, logps, mask, params,
                                                  batch.engine_ratio)
    if settings.off_policy_threshold is not None:
        sampling = batch.sampling_logps if batch.sampling_logps is not None else old_logps
        sampling = logps.detach() if sampling is None else sampling
        per_token = per_token * off_policy_mask(adv, logps, sampling, mask, settings.off_policy_threshold)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    metrics: dict[str, Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps (the reference model's log-probs).")
        kl = kl_k3(logps, ref_logps)
        if settings.kl_bias_correction:
            kl = kl * torch.exp(log_ratio)  # [B, T] (token ratios) or [B, T] * [B, 1] (sequence ratios)
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    aggregate = AGGREGATIONS[aggregation_name]
    loss = aggregate(per_token, mask, norm)
    metrics.update({name: _metric_mean(flag, mask) for name, flag in flags.items()})
    per_sequence = {name: _per_sequence(flags[source], mask) for name, (source, _) in SEQUENCE_METRICS.items()
                    if source in flags}
    if entropy_coef is not None:
        if entropy is None:
            raise ValueError("entropy_coef needs entropy (the per-token entropy of the policy).")
        # TRL's `policy_loss`: the policy term (KL included) before the division by the accumulation steps.
        metrics["policy_loss"] = aggregate(per_token.detach(), mask, norm._replace(accumulation_steps=1))
        effective = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * entropy_bonus(entropy, effective, norm.accumulation_steps)
    return LossOutput(loss, metrics, per_sequence)
