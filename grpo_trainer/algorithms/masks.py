"""Which completions and tokens the policy term trains on: the off-policy sequence mask and the high-entropy token
mask, pure tensor functions. Both multiply the per-token policy loss (not the KL term) before aggregation; the
loss normalisers keep counting every completion token, as in TRL.

Shapes: `B` completions, `T` completion tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["high_entropy_mask", "off_policy_mask"]


def off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor,
                    off_policy_threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9): drop a completion whose advantage is
    negative and whose policy has drifted from the one that sampled it by more than `off_policy_threshold`, measured
    as the mean over its tokens of log pi_sampling - log pi_theta (a KL estimate; pi_theta is not differentiated). A
    negative sample far off-policy is more likely noise than signal; positive ones are always kept.

    Args:
        advantages: `[B]`, `[B, 1]` or `[B, T]`.
        per_token_logps: `[B, T]` log pi_theta. sampling_per_token_logps: `[B, T]` log-probs under the sampling
            policy; NaN (a token the sampler could not score) counts as no drift. (TRL's parameter names: the
            trainer exposes this function as TRL's `get_off_policy_mask`.)
        mask: `[B, T]` 1 for completion tokens.
    Returns: `[B, 1]` (or `[B, T]` for token advantages) in `mask`'s dtype, 1 = keep, 0 = drop.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    drift = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return ((advantages >= 0) | (mean_drift <= off_policy_threshold)).to(mask.dtype)


def high_entropy_mask(entropy: Tensor, mask: Tensor, pooled: Tensor, level: float) -> Tensor:
    """True for completion tokens whose entropy is at least the `level` quantile (linear interpolation) of
    `pooled`: the "80/20" rule of Wang et al. 2025 (arXiv:2506.01939), where only the high-entropy forking tokens
    carry the policy gradient. `level` = 1 - top_entropy_quantile.

    Args:
        entropy: `[B, T]`. mask: `[B, T]` 1 for completion tokens (the others are never kept).
        pooled: `[K]` the entropies of the completion tokens the quantile is taken over (in the trainer: every
            process's). None at all keeps no token.
    Returns: `[B, T]` bool.
    """
    if pooled.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(pooled.float(), level)
    return (entropy >= threshold) & mask.bool()
