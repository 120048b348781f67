"""Truncated sampling (top-k, top-p, min-p): which tokens a sampler could draw at a position (its kept support), the
probability mass they hold, and a compact form of the support: pure tensor functions.

With truncation the sampler draws from the tempered softmax renormalised over the kept support S, so the log-prob of
a sampled token under the sampling distribution is log p(a) - log p(S), where p is the full tempered softmax. A
trainer that scores the full softmax is off by log p(S) (< 0) on every token, so its importance ratio against the
sampler's log-probs is p(S), not 1 (TRL #6789). Scoring with a softmax over S (DeepSeek-V3.2's "keep sampling
mask", arXiv:2512.02556 section 3.1) removes that bias.

Decisions:

1. The rules are transformers' own warpers (`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`), applied to
   the tempered logits in the order `GenerationConfig` applies them (temperature, top-k, top-p, min-p), each on the
   scores the previous one left: the kept support is the set of finite scores afterwards. Ties, the boundary token
   and `min_tokens_to_keep` are therefore theirs, exactly. (vLLM applies min-p before top-k/top-p: with min-p and
   another truncation together, only a support the engine returns is exact there.)
2. A support recomputed from the trainer's logits always includes the sampled token: the trainer's logits differ
   from the sampler's by rounding, and a token the sampler drew at the boundary must never get probability 0.
3. A support travels packed, one bit per vocabulary entry (`pack` / `unpack`, `[..., ceil(V / 8)]` uint8): bit
   `v % 8` of byte `v // 8` is token v. A `[B, T, V]` bool tensor would be 8x larger; token-id lists would make a
   round's tensors ragged.

Shapes: `N` positions, `V` vocabulary, `W = ceil(V / 8)` packed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.generation import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["Truncation", "kept_support", "log_kept_mass", "pack", "unpack", "with_tokens"]

_BIT_WEIGHTS = tuple(1 << i for i in range(8))


@dataclass(frozen=True)
class Truncation:
    """The sampler's truncation settings, as `GenerationConfig` names them (0 / 1.0 / None: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    min_tokens_to_keep: int = 1

    @property
    def active(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p is not None

    @classmethod
    def of(cls, config: Any) -> Truncation:
        """The truncation a sampling `GenerationConfig` applies (none when it does not sample)."""
        if not getattr(config, "do_sample", True):
            return cls()
        top_p = getattr(config, "top_p", None)
        return cls(getattr(config, "top_k", None) or 0, 1.0 if top_p is None else float(top_p),
                   getattr(config, "min_p", None))

    def warpers(self) -> list:
        """Transformers' warpers for these settings, in `GenerationConfig`'s order (decision 1)."""
        out: list = []
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=self.min_tokens_to_keep))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=self.min_tokens_to_keep))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=self.min_tokens_to_keep))
        return out


def kept_support(tempered_logits: Tensor, truncation: Truncation) -> Tensor:
    """`[N, V]` bool: the tokens `truncation` keeps from the tempered logits `[N, V]` (decision 1). A token whose
    logit is already -inf (suppressed) is never kept."""
    scores = tempered_logits.float()
    for warper in truncation.warpers():
        scores = warper(None, scores)
    return scores > -torch.inf


def with_tokens(kept: Tensor, tokens: Tensor) -> Tensor:
    """`kept` `[N, V]` with each row's sampled token `tokens` `[N]` added (decision 2)."""
    return kept.scatter(1, tokens[:, None], True)


def log_kept_mass(tempered_logits: Tensor, kept: Tensor) -> Tensor:
    """`[N]` log of the probability the full tempered softmax of `tempered_logits` `[N, V]` gives the `kept`
    tokens: log sum_{v in S} p_v = logsumexp(z_S) - logsumexp(z). 0 where nothing was cut."""
    logits = tempered_logits.float()
    return torch.logsumexp(logits.masked_fill(~kept, -torch.inf), dim=-1) - torch.logsumexp(logits, dim=-1)


def pack(kept: Tensor) -> Tensor:
    """`[..., V]` bool -> `[..., ceil(V / 8)]` uint8 (decision 3)."""
    V = kept.shape[-1]
    padded = torch.nn.functional.pad(kept.to(torch.uint8), (0, -V % 8))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=kept.device)
    return (padded.view(*kept.shape[:-1], -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack(packed: Tensor, vocab_size: int) -> Tensor:
    """`[..., ceil(V / 8)]` uint8 -> `[..., V]` bool (decision 3)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed[..., None] & weights) != 0  # [..., W, 8]
    return bits.flatten(-2)[..., :vocab_size]
