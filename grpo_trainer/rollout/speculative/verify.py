"""The exact rule for point-mass drafts.

A draft proposes one token per position with probability 1. At each verified position the sampler draws x from the
target distribution (every logits processor applied, as without drafts) and the drafted token is accepted while x
equals it; the first mismatch commits x itself and ends the span. What is committed at each position is a draw from
the target given the committed prefix, whatever the draft was: so the completions' distribution is the target's.
(Not the rule that, after a rejection, samples from the full target again without the residual correction: that
biases rollouts, SPEC-RL#14. With point-mass drafts the residual is the target with the draft token removed, and
"draw x, commit it" samples exactly that mixture.)

Each position's draw uses uniforms fixed for that (row, token index) before the round starts (`loop`), so the
committed tokens are a function of the uniforms and the model's logits alone: drafting changes how many forwards a
round takes, not what it samples (up to the float rounding of a forward over several positions).

Shapes: `N` rows, `Q` positions (the row's last token, then `Q - 1` draft positions).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["committed_counts"]


def committed_counts(drawn: Tensor, drafts: Tensor, lengths: Tensor, eos_ids: Tensor) -> Tensor:
    """Tokens each row commits `[N]` (1 to Q): the draws `drawn` `[N, Q]` up to and including the first that differs
    from the draft `drafts` `[N, Q - 1]` (row i drafted its first `lengths[i]` entries), is past the draft, or ends the
    completion (an EOS id in `eos_ids`). E.g. drawn [5, 6, 9], drafts [5, 7], length 2 -> 2 (5, then 6 != 7)."""
    N, Q = drawn.shape
    positions = torch.arange(Q - 1, device=drawn.device)
    held = (drawn[:, :-1] == drafts) & (positions < lengths[:, None]) & ~torch.isin(drawn[:, :-1], eos_ids)
    return held.int().cumprod(1).sum(1) + 1
