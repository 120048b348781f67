"""Drawing the next token: greedy argmax, or a categorical draw by inverting float64 cumulative sums.

`torch.multinomial` draws one random number per vocabulary entry on CPU. Here a draw takes two uniform numbers per
row, in two levels (a block of tokens by its mass, then a token inside it): the distribution of
`torch.multinomial`, not its random stream, so sampled tokens differ from `generate`'s for a given seed while greedy
tokens are identical.

Shapes: `B` rows, `V` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ONE_LEVEL_MAX_VOCAB", "SAMPLE_BLOCK", "sample_from_logits", "sample_from_probs"]


def sample_from_logits(scores: Tensor, do_sample: bool, u: Tensor | None = None) -> Tensor:
    """One token per row from processed logits `[B, V]` (float32): argmax, or a draw by CDF inversion (with the
    uniforms `u` `[B, 2]` where given, see `sample_from_probs`)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return sample_from_probs(torch.softmax(scores, dim=-1, dtype=torch.float64), u=u)


# `sample_from_probs`: tokens per block of the two-level draw, and the vocabulary size up to which one cumulative sum
# is cheaper than two (a cumulative sum runs sequentially over its row; benchmarks/RESULTS.md, "decode step").
SAMPLE_BLOCK = 128
ONE_LEVEL_MAX_VOCAB = 4096


def sample_from_probs(probs: Tensor, block: int = SAMPLE_BLOCK, one_level_max: int | None = None,
                      u: Tensor | None = None) -> Tensor:
    """One token per row of probabilities `[B, V]` (filtered tokens 0), in two draws: a block of `block`
    consecutive tokens with probability equal to its mass, then a token inside it with probability equal to its
    share of that mass. Their product is the categorical distribution. A cumulative sum runs sequentially; this
    needs one vectorised sum over V and two cumulative sums of <= V / block and `block` entries. `u` `[B, 2]`
    float64 uniforms in [0, 1) (drawn here when None): the token is a function of them and `probs` alone, which
    the speculative loop uses to draw each position's token from uniforms fixed before any draft is verified."""
    B, V = probs.shape
    if u is None:
        u = torch.rand((B, 2), dtype=torch.float64, device=probs.device)
    if V <= max(block, ONE_LEVEL_MAX_VOCAB if one_level_max is None else one_level_max):
        return _inverse_cdf(probs, u[:, :1])
    full = V // block * block
    masses = probs[:, :full].reshape(B, full // block, block).sum(-1, dtype=torch.float64)  # [B, V // block]
    if full < V:
        masses = torch.cat([masses, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    columns = _inverse_cdf(masses, u[:, :1])[:, None] * block + torch.arange(block, device=probs.device)
    inside = probs.gather(1, columns.clamp(max=V - 1)).masked_fill_(columns >= V, 0)  # [B, block]
    return columns.gather(1, _inverse_cdf(inside, u[:, 1:])[:, None]).squeeze(1)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Per row of non-negative `weights` `[B, N]`, the first index whose float64 cumulative weight exceeds
    `u * total` (`u` `[B, 1]` uniform in [0, 1)): index i with probability weights[i] / total. A zero weight's
    cumulative value equals its predecessor's, so it is never the first to exceed anything: never drawn."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)
