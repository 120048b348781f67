"""How many tokens each row drafts per forward, and how wide a forward is worth making.

Decisions:

1. Per row, a draft length that grows while drafts are accepted and backs off when they miss (as assisted
   decoding's heuristic schedule does): all accepted doubles it, a partial acceptance keeps what was accepted plus
   one, none accepted halves it; at zero the row stops drafting for a pause that doubles with every further
   miss (up to `_MAX_PAUSE` forwards), then tries one token again (`DraftPolicy`).
2. Verifying k draft tokens costs one forward over k + 1 positions. While a forward is memory-bound (a GPU's
   decode step, a small model's dispatch-bound CPU step) extra positions are nearly free; once it is compute-bound (a
   0.5B model on one CPU thread: benchmarks/RESULTS.md, "Speculative rollouts") they cost what they compute. So the
   forward's width can be chosen by measurement (`ForwardCost`, policy "measured", opt-in): the seconds of each
   forward are fitted as `a + b x positions`, each row's drafts are expected to commit `1 + p + ... + p^k` tokens (p
   its acceptance rate, estimated per row with the round's as prior), and the width with the most expected tokens per
   second wins, the plain width (one position) included. Until two widths have been timed the rows draft what
   decision 1 allows; a run that keeps choosing the plain width times a two-position forward every `_EXPLORE_EVERY`
   forwards, so a cost model fitted on few widths is corrected. Timings decide only how many forwards a round takes,
   never what it samples (`verify`); but the widths a run computes at then vary with the machine's load, and with
   them the float rounding of the values kept (log-probs to about 1e-7): the same tokens, not the same bits, which is
   why it is not the default.
3. Whatever the choice, a forward feeds at most `max_verify_tokens` positions (N rows x Q): a full batch drafts
   little, a batch's tail (a few long rows left) up to `max_draft_tokens` per row. Policy "fixed" uses only this
   and decision 1 (the default: no timings, so a seeded run computes at the same widths and reproduces bit for bit).
"""

from __future__ import annotations

from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

__all__ = ["DraftPolicy", "ForwardCost", "expected_tokens", "width"]

_MAX_PAUSE = 16
_EXPLORE_EVERY = 32


class DraftPolicy:
    """Per-row draft lengths for a round of `rows` rows (decision 1), and the forward's cut (decision 3)."""

    def __init__(self, settings: SpeculativeSettings, rows: int) -> None:
        self.settings = settings
        self.length = [max(1, settings.max_draft_tokens // 2)] * rows
        self.pause = [0] * rows  # forwards left without drafting
        self.next_pause = [1] * rows
        self.held = [0] * rows  # draft tokens accepted, per row
        self.missed = [0] * rows  # drafts that ended in a rejection, per row

    def limits(self, rows: list[int], remaining: list[int]) -> list[int]:
        """The most draft tokens each of `rows` may take this forward; `remaining[i]`: tokens row `rows[i]` may
        still commit after its next one (the length cap)."""
        per_row = max(0, self.settings.max_verify_tokens // max(1, len(rows)) - 1)  # decision 3
        return [0 if self.pause[r] else min(self.length[r], left, per_row) for r, left in zip(rows, remaining)]

    def acceptance(self, rows: list[int]) -> list[float]:
        """Each row's estimated chance that a draft token holds, given the one before it did: accepted / (accepted
        + drafts that missed), a geometric run's estimate, with the round's as a prior of two drafts' weight."""
        held, missed = sum(self.held), sum(self.missed)
        prior = (held + 1) / (held + missed + 2)
        return [(self.held[r] + 2 * prior) / (self.held[r] + self.missed[r] + 2) for r in rows]

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
            self.held[r] += a
            self.missed[r] += a < k
            if a == k:
                self.length[r], self.next_pause[r] = min(cap, 2 * k), 1
            elif a > 0:
                self.length[r] = a + 1
            elif self.length[r] > 1:
                self.length[r] //= 2
            else:
                self.pause[r] = self.next_pause[r]
                self.next_pause[r] = min(_MAX_PAUSE, 2 * self.next_pause[r])


class ForwardCost:
    """A forward's seconds as `a + b x positions`, least squares over the forwards timed, older ones decayed
    (decision 2). Kept across rounds by the backend."""

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.n = self.p = self.t = self.pp = self.pt = 0.0
        self.widths: set[int] = set()
        self.plain_run = 0  # consecutive forwards that chose the plain width

    def observe(self, positions: int, seconds: float) -> None:
        d = self.decay
        self.n, self.p, self.t = d * self.n + 1, d * self.p + positions, d * self.t + seconds
        self.pp, self.pt = d * self.pp + positions * positions, d * self.pt + positions * seconds
        self.widths.add(positions)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None until two different position counts have been timed."""
        spread = self.n * self.pp - self.p * self.p
        if len(self.widths) < 2 or spread <= 1e-9 * max(1.0, self.pp * self.n):
            return None
        b = max(0.0, (self.n * self.pt - self.p * self.t) / spread)
        a = max(1e-9, (self.t - b * self.p) / self.n)
        return a, b


def expected_tokens(drafted: int, acceptance: float) -> float:
    """Tokens a row is expected to commit from a forward that verifies `drafted` draft tokens, each holding with
    chance `acceptance` given the one before held: 1 + p + ... + p^drafted."""
    return sum(acceptance ** i for i in range(drafted + 1))


def width(lengths: list[int], acceptance: list[float], cost: ForwardCost) -> int:
    """Positions per row Q for a forward of rows with drafts of `lengths` (decision 2): 1 + max(lengths) while the
    cost is unknown, else the Q with the most expected tokens per second."""
    longest = max(lengths, default=0)
    coefficients = cost.coefficients()
    if coefficients is None or longest == 0:
        return 1 + longest
    a, b = coefficients
    N = len(lengths)
    best, best_rate = 1, N / (a + b * N)
    for Q in range(2, longest + 2):
        rate = sum(expected_tokens(min(k, Q - 1), p) for k, p in zip(lengths, acceptance)) / (a + b * N * Q)
        if rate > best_rate:
            best, best_rate = Q, rate
    if best == 1:
        cost.plain_run += 1
        if cost.plain_run >= _EXPLORE_EVERY:  # decision 2: time a wider forward now and then
            cost.plain_run = 0
            return 2
    else:
        cost.plain_run = 0
    return best
