"""How many tokens each row drafts per forward.

Decisions:

1. Verifying k draft tokens costs one forward over k + 1 positions. While a forward is memory-bound (a GPU's decode
   step, a small model's dispatch-bound CPU step) extra positions are nearly free; once it is compute-bound they cost
   what they compute. So a forward feeds at most `max_verify_tokens` positions (N rows x Q): a full batch drafts
   little, a batch's tail (a few long rows left) drafts up to `max_draft_tokens` per row.
2. Per row, a draft length that grows while drafts are accepted and backs off when they miss (as assisted
   decoding's heuristic schedule does): all accepted doubles it, a partial acceptance keeps what was accepted plus
   one, none accepted halves it; at zero the row stops drafting for a pause that doubles with every further
   miss (up to `_MAX_PAUSE` forwards), then tries one token again.
"""

from __future__ import annotations

from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

__all__ = ["DraftPolicy"]

_MAX_PAUSE = 16


class DraftPolicy:
    """Per-row draft lengths for a round of `rows` rows (decision 2), and the forward's cut (decision 1)."""

    def __init__(self, settings: SpeculativeSettings, rows: int) -> None:
        self.settings = settings
        self.length = [max(1, settings.max_draft_tokens // 2)] * rows
        self.pause = [0] * rows  # forwards left without drafting
        self.next_pause = [1] * rows

    def limits(self, rows: list[int], remaining: list[int]) -> list[int]:
        """The most draft tokens each of `rows` may take this forward; `remaining[i]`: tokens row `rows[i]` may
        still commit after its next one (the length cap)."""
        per_row = max(0, self.settings.max_verify_tokens // max(1, len(rows)) - 1)  # decision 1
        return [0 if self.pause[r] else min(self.length[r], left, per_row) for r, left in zip(rows, remaining)]

    def update(self, rows: list[int], drafted: list[int], accepted: list[int]) -> None:
        """After a forward: row `rows[i]` drafted `drafted[i]` tokens of which the first `accepted[i]` held."""
        cap = self.settings.max_draft_tokens
        for r, k, a in zip(rows, drafted, accepted):
            if self.pause[r]:
                self.pause[r] -= 1
                if not self.pause[r]:
                    self.length[r] = 1
                continue
            if k == 0:
                continue
            if a == k:
                self.length[r], self.next_pause[r] = min(cap, 2 * k), 1
            elif a > 0:
                self.length[r] = a + 1
            elif self.length[r] > 1:
                self.length[r] //= 2
            else:
                self.pause[r] = self.next_pause[r]
                self.next_pause[r] = min(_MAX_PAUSE, 2 * self.next_pause[r])
