"""How one token is scored: the policy surrogates that `losses.policy_loss` aggregates, pure tensor functions.

Decisions:

1. Every surrogate has one signature, `fn(log_ratio, token_log_ratio, advantages, logps, mask, params,
   engine_ratio=None)`, and takes what it needs: the importance ratio at the configured level (token `[B, T]` or
   sequence `[B, 1]`), the token log-ratios (VESPO builds its own sequence weight from them), log pi (CISPO, VESPO),
   the mask (VESPO's sums) and the hyperparameters (`SurrogateParams`). So `SURROGATES` is a plain table and adding
   one touches nothing else.
2. A surrogate also returns the quantities TRL logs for it, under TRL's metric names, each a `[B, T]` or `[B, 1]`
   tensor whose masked mean is the metric: the clip fractions for the clipped surrogate, `cispo_clip_ratio`,
   `vespo/phi_seq_mean`. SAPO logs none, as in TRL.
3. `engine_ratio` `[B, T]` is the inference engine's importance weight (`engine_correction`; None without one). As
   in TRL, it multiplies the token loss of every surrogate but VESPO, which folds it into its sequence weight. The
   metrics ignore it.

Shapes: `B` completions, `T` completion tokens. Advantages are `[B, 1]` or `[B, T]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "SURROGATES",
    "Surrogate",
    "SurrogateParams",
    "cispo_surrogate",
    "clipped_surrogate",
    "gamma_weights",
    "sapo_surrogate",
    "vespo_surrogate",
]


class SurrogateParams(NamedTuple):
    """Hyperparameters of the surrogates (TRL's config names in brackets)."""

    epsilon_low: float = 0.2  # lower clip range [epsilon]
    epsilon_high: float = 0.2  # upper clip range; CISPO's absolute cap on the weight [epsilon_high]
    delta: float | None = None  # INTELLECT-2 cap on the unclipped ratio [delta]
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


Surrogate = Callable[..., tuple[Tensor, dict[str, Tensor]]]  # (log_ratio, token_log_ratio, advantages, logps, mask,
#                                                           params, engine_ratio=None) -> (loss, metric flags)


def _engine_weighted(loss: Tensor, engine_ratio: Tensor | None) -> Tensor:
    """The token loss times the engine's importance weight (decision 3), when there is one."""
    return loss if engine_ratio is None else loss * engine_ratio


def _by_sign(advantages: Tensor, positive: float, negative: float, dtype: torch.dtype, strict: bool) -> Tensor:
    """`positive` where A > 0 (A >= 0 unless `strict`), else `negative`, in `dtype` (torch.where on two Python
    floats would give float32)."""
    chosen = advantages > 0 if strict else advantages >= 0
    return torch.where(chosen, positive, negative).to(dtype)


def clipped_surrogate(log_ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, logps: Tensor, mask: Tensor,
                      params: SurrogateParams, engine_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), per token: -min(rho~ A, clip(rho, 1-eps_l, 1+eps_h) A), where
    rho~ = min(rho, delta) with INTELLECT-2 two-sided clipping (`delta`), else rho.

    Metrics: where the clip binds, low (rho~ < 1-eps_l with A < 0) and high (rho~ > 1+eps_h with A > 0), as TRL
    counts them (on the delta-capped ratio)."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - params.epsilon_low, 1 + params.epsilon_high)
    unclipped = ratio if params.delta is None else torch.clamp(ratio, max=params.delta)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    low = (unclipped < 1 - params.epsilon_low) & (advantages < 0)
    high = (unclipped > 1 + params.epsilon_high) & (advantages > 0)
    flags = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    return _engine_weighted(loss.expand(torch.broadcast_shapes(logps.shape, loss.shape)), engine_ratio), flags


def cispo_surrogate(log_ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, logps: Tensor, mask: Tensor,
                    params: SurrogateParams, engine_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): -sg(min(rho, eps_high)) A log pi. Every token keeps a gradient; only
    the importance weight is capped. As in TRL, `epsilon_high` is the absolute cap (suggested 5.0).
    Metric `cispo_clip_ratio`: where the cap binds with A > 0."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=params.epsilon_high).detach()
    flags = {"cispo_clip_ratio": (ratio > params.epsilon_high) & (advantages > 0)}
    return _engine_weighted(-weight * advantages * logps, engine_ratio), flags


def sapo_surrogate(log_ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, logps: Tensor, mask: Tensor,
                   params: SurrogateParams, engine_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (arXiv:2511.20347): a soft sigmoid gate instead of a hard clip, -(4/tau) sigma(tau (rho-1)) A, with
    tau = tau_pos for A > 0 else tau_neg. Its gradient at rho = 1 equals the unclipped surrogate's."""
    ratio = torch.exp(log_ratio)
    dtype = torch.promote_types(ratio.dtype, advantages.dtype)
    tau = _by_sign(advantages, params.sapo_temperature_pos, params.sapo_temperature_neg, dtype, strict=True)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    return _engine_weighted(loss.expand(torch.broadcast_shapes(logps.shape, loss.shape)), engine_ratio), {}


_LOG_MIN_WEIGHT = math.log(1e-8)  # VESPO's floor on the sequence weight w, in log space
_LOG_MAX_WEIGHT = 20.0


def gamma_weights(advantages: Tensor, log_ratio_per_token: Tensor, mask: Tensor,
                  importance_sampling_ratio: Tensor | None = None,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """VESPO's sequence weight phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w) (arXiv:
    2602.10693), a Gamma-shaped function of the sequence importance ratio w with phi(1) = 1 that fades out sequences
    far off-policy on either side; (k, lambda) are the `_pos` pair where A >= 0, else the `_neg` pair.

    log w = sum over the sequence's tokens of log rho (each clamped to +-20), plus, if given, the sum of the log of
    the sampler-correction ratios `importance_sampling_ratio` `[B, T]` (each clamped to [log 1e-8, 20]), then clamped to
    [log 1e-8, 20]. A non-finite phi becomes 0. Not differentiated: phi only scales the gradient of -A log pi.

    Args (TRL's names: the trainer exposes this as TRL's `get_gamma_weights`): advantages `[B, 1]` or `[B, T]`,
    log_ratio_per_token and mask `[B, T]`. Returns `[B, 1]` (or `[B, T]`)."""
    with torch.no_grad():
        log_w = (torch.clamp(log_ratio_per_token, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # [B, 1]
        if importance_sampling_ratio is not None:
            log_w = log_w + torch.clamp(torch.log(importance_sampling_ratio), _LOG_MIN_WEIGHT, _LOG_MAX_WEIGHT).sum(
                -1, keepdim=True)
        log_w = torch.clamp(log_w, _LOG_MIN_WEIGHT, _LOG_MAX_WEIGHT)
        dtype = torch.promote_types(log_w.dtype, advantages.dtype)
        k = _by_sign(advantages, k_pos, k_neg, dtype, strict=False)
        lam = _by_sign(advantages, lambda_pos, lambda_neg, dtype, strict=False).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_surrogate(log_ratio: Tensor, token_log_ratio: Tensor, advantages: Tensor, logps: Tensor, mask: Tensor,
                    params: SurrogateParams, engine_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO: -sg(phi(w)) A log pi, a soft, asymmetric sequence-level weight instead of a hard clip. The sequence
    ratio w comes from the token log-ratios whatever `importance_sampling_level` says (as in TRL), times the
    engine's importance weights when given (`gamma_weights`' `importance_ratio`), which then scale nothing else.
    Metric `vespo/phi_seq_mean`: the mean phi over sequences."""
    phi = gamma_weights(advantages, token_log_ratio, mask, engine_ratio, params.vespo_k_pos, params.vespo_lambda_pos,
                        params.vespo_k_neg, params.vespo_lambda_neg)
    return -phi * advantages * logps, {"vespo/phi_seq_mean": phi}


SURROGATES: dict[str, Surrogate] = {
    "clip": clipped_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
    "vespo": vespo_surrogate,
}
