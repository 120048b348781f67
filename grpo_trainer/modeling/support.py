"""The kept support of truncated sampling, as a log-prob forward uses it (`algorithms.truncation` has the rules).

A forward scores each completion token over the tokens the sampler could draw at that position: the sampler's own
support where the rollout returned it (`packed`, one row per scored position), else the one the truncation rules give
on the forward's own logits, the sampled token always included. `renormalise=False` (`keep_sampling_mask=False`)
scores the full softmax, as TRL does, and only measures the kept mass.

Shapes: `N` scored positions, `n` of them in one chunk, `V` vocabulary, `W = ceil(V / 8)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from grpo_trainer.algorithms.truncation import Truncation, kept_support, unpack, with_tokens

__all__ = ["KeptSupport"]


@dataclass(frozen=True)
class KeptSupport:
    truncation: Truncation
    packed: Tensor | None = None  # [N, W] uint8: the sampler's supports, one row per scored position
    renormalise: bool = True  # log-probs over the kept support (False: the full softmax, the kept mass measured)
    collect: bool = False  # return the supports used, packed (a forward at the sampling weights keeps them)

    def mask(self, tempered_logits: Tensor, tokens: Tensor, rows: slice) -> Tensor:
        """`[n, V]` bool: the support of the positions `rows` of this forward, whose tempered logits `[n, V]` and
        sampled tokens `[n]` are given."""
        if self.packed is not None:
            kept = unpack(self.packed[rows], tempered_logits.shape[-1])
        else:
            kept = kept_support(tempered_logits, self.truncation)
        return with_tokens(kept, tokens)

    def rows(self, index: slice | Tensor) -> KeptSupport:
        """The support of the positions `index` only."""
        return self if self.packed is None else replace(self, packed=self.packed[index])
