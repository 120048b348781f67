"""The per-token policy objective and its reduction: pure tensor functions, no `.item()`, no model.

Decisions:

1. Loss = surrogate (how one token is scored) then aggregation (how token losses become one number) + beta * KL.
   TRL's `loss_type` names pick both at once (`grpo`, `bnpo`, `dr_grpo`, `dapo` share the clipped surrogate and
   differ in aggregation; `cispo`, `sapo` change the surrogate); `LOSS_TYPES` maps each name to its pair.
2. Every aggregation already includes gradient-accumulation scaling, so the trainer sets
   `loss_is_scaled_for_ga = True`. Summing a window's micro-batch losses and averaging over processes (what
   DDP/DeepSpeed do to gradients) gives the documented quantity; `dapo` is then the token mean over the whole
   accumulated global batch, independent of how it was split (DAPO, arXiv:2503.14476, section 3.3).
3. On-policy (no `old_logps`), the ratio is `exp(logp - logp.detach())`: 1 in value, grad of log pi in gradient.

Shapes: `B` completions in the micro-batch, `T` completion tokens. Masks are 0/1 float or bool `[B, T]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "LOSS_TYPES",
    "SURROGATES",
    "LossNorm",
    "LossOutput",
    "clipped_surrogate",
    "high_entropy_mask",
    "cispo_surrogate",
    "kl_k3",
    "log_importance_ratio",
    "policy_loss",
    "sapo_surrogate",
]

ImportanceLevel = Literal["token", "sequence"]


class LossNorm(NamedTuple):
    """Counts the aggregations divide by, fixed for one gradient-accumulation window on one process.

    Attributes:
        accumulation_steps: micro-batches in the window (gradient accumulation steps).
        window_tokens: active completion tokens in the window summed over all processes, divided by the
            number of processes (the `dapo`/`cispo` normaliser).
        max_completion_length: the `dr_grpo` constant normaliser.
    """

    accumulation_steps: int = 1
    window_tokens: float | Tensor = 1.0
    max_completion_length: int = 1


class LossOutput(NamedTuple):
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, Tensor]  # detached scalars; reduced and `.item()`-ed by the trainer at logging time


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


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    logps: Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), per token: -min(rho*A, clip(rho, 1-eps_l, 1+eps_h)*A).

    `delta` (INTELLECT-2 two-sided clipping) caps the unclipped ratio at `delta` as well.
    Args: log_ratio `[B, T]` or `[B, 1]`; advantages `[B, 1]` or `[B, T]`. Returns `[B, T]` and token masks of
    where the clip is active: `low` (rho < 1-eps_l, A < 0), `high` (rho > 1+eps_h, A > 0).
    """
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    shape = torch.broadcast_shapes(logps.shape, ratio.shape)
    return loss.expand(shape), {"low": low.expand(shape), "high": high.expand(shape)}


def cispo_surrogate(
    log_ratio: Tensor, advantages: Tensor, logps: Tensor, epsilon_low: float, epsilon_high: float, delta=None
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(min(rho, eps_high)) * A * log pi. Every token keeps a gradient;
    only the importance weight is capped. As in TRL, `epsilon_high` is the absolute cap (suggested 5.0)."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=epsilon_high).detach()
    high = (ratio > epsilon_high) & (advantages > 0)
    shape = torch.broadcast_shapes(logps.shape, ratio.shape)
    return -weight * advantages * logps, {"low": torch.zeros(shape, dtype=torch.bool, device=logps.device),
                                          "high": high.expand(shape)}


def sapo_surrogate(
    log_ratio: Tensor, advantages: Tensor, logps: Tensor, epsilon_low: float, epsilon_high: float, delta=None,
    temperature_pos: float = 1.0, temperature_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (arXiv:2511.20347): a soft sigmoid gate instead of a hard clip, -(4/tau) sigma(tau (rho-1)) A, with
    tau = tau_pos for A > 0 else tau_neg. Its gradient at rho = 1 equals the unclipped surrogate's."""
    ratio = torch.exp(log_ratio)
    # torch.where on two Python floats gives the default dtype (float32); keep the inputs' precision.
    dtype = torch.promote_types(ratio.dtype, advantages.dtype)
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(dtype)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    shape = torch.broadcast_shapes(logps.shape, ratio.shape)
    none = torch.zeros(shape, dtype=torch.bool, device=logps.device)
    return loss.expand(shape), {"low": none, "high": none}


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(r) - r - 1 with r = ref - logp.
    Non-negative, 0 where the two agree, unbiased under samples from pi_theta."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1.0


def _sequence_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`grpo`: each sequence's token mean, then the mean over sequences (the original GRPO objective)."""
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.mean() / norm.accumulation_steps


def _batch_token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`bnpo`: token mean over the local micro-batch."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0) / norm.accumulation_steps


def _constant_length(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`dr_grpo` (arXiv:2503.20783): token sum over a constant, B * max_completion_length, so length does not
    change a token's weight."""
    return (loss * mask).sum() / (loss.shape[0] * norm.max_completion_length) / norm.accumulation_steps


def _global_token_mean(loss: Tensor, mask: Tensor, norm: LossNorm) -> Tensor:
    """`dapo`: token sum over the window's average active tokens per process; summed over micro-batches and
    averaged over processes this is the token mean of the whole accumulated global batch."""
    return (loss * mask).sum() / torch.as_tensor(norm.window_tokens, dtype=loss.dtype).clamp(min=1.0)


Aggregation = Callable[[Tensor, Tensor, LossNorm], Tensor]
Surrogate = Callable[..., tuple[Tensor, dict[str, Tensor]]]

AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": _sequence_mean,
    "bnpo": _batch_token_mean,
    "dr_grpo": _constant_length,
    "dapo": _global_token_mean,
}
SURROGATES: dict[str, Surrogate] = {"clip": clipped_surrogate, "cispo": cispo_surrogate, "sapo": sapo_surrogate}
# loss_type -> (surrogate, aggregation), the two axes TRL's single name packs together.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "grpo"),
    "bnpo": ("clip", "bnpo"),
    "dr_grpo": ("clip", "dr_grpo"),
    "dapo": ("clip", "dapo"),
    "cispo": ("cispo", "dapo"),
    "sapo": ("sapo", "grpo"),
}


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


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
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: ImportanceLevel = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> LossOutput:
    """The GRPO objective for one micro-batch.

    Args:
        logps: `[B, T]` log pi_theta of the completion tokens (differentiable).
        advantages: `[B]` (one per completion) or `[B, T]`.
        mask: `[B, T]` 1 for tokens in the loss.
        old_logps / ref_logps: `[B, T]` or None (on-policy / no KL term).
        kl_bias_correction: multiply each token's KL by the (differentiable) importance ratio rho, token- or
            sequence-level as `importance_sampling_level` says (DeepSeek-V3.2, arXiv:2512.02556): the KL term's
            gradient becomes the unbiased reverse-KL gradient under samples from pi_old. On-policy rho is 1 in
            value, so only the gradient changes: d(rho * k3)/d logp = k3 + d k3/d logp.
    Returns: the loss and detached metrics: `kl` (mean token k3), `clip_ratio/low_mean`, `clip_ratio/high_mean`,
    `clip_ratio/region_mean`, each a masked token mean over this micro-batch.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {sorted(LOSS_TYPES)}.")
    surrogate_name, aggregation_name = LOSS_TYPES[loss_type]
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    log_ratio = log_importance_ratio(logps, old_logps, mask, importance_sampling_level)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    gate = {"temperature_pos": sapo_temperature_pos, "temperature_neg": sapo_temperature_neg}
    per_token, clip = SURROGATES[surrogate_name](log_ratio, adv, logps, epsilon_low, eps_high, delta,
                                                 **(gate if surrogate_name == "sapo" else {}))
    metrics: dict[str, Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps (the reference model's log-probs).")
        kl = kl_k3(logps, ref_logps)
        if kl_bias_correction:
            kl = kl * torch.exp(log_ratio)  # [B, T] (token ratios) or [B, T] * [B, 1] (sequence ratios)
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = AGGREGATIONS[aggregation_name](per_token, mask, norm)
    low, high = _masked_mean(clip["low"].to(mask), mask), _masked_mean(clip["high"].to(mask), mask)
    metrics.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low + high})
    return LossOutput(loss, metrics)


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """1 for tokens whose entropy is in the top `quantile` of the valid (`mask`) tokens, else 0: the "80/20"
    rule of Wang et al. 2025 (arXiv:2506.01939), where only high-entropy forking tokens carry the gradient.
    Args: entropy, mask `[B, T]`. Returns `[B, T]` float."""
    valid = entropy[mask.bool()]
    if valid.numel() == 0:
        return mask.float()
    threshold = torch.quantile(valid.float(), 1.0 - quantile)
    return (entropy >= threshold).float()
