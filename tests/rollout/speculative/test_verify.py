"""The point-mass acceptance rule (`speculative.verify`): hand-counted cases, and the committed tokens' joint
distribution equal to the target's (chi-square, 10^5 draws), where the rule that samples from the full target
after a rejection (SPEC-RL#14) fails the same test."""

import math

import pytest
import torch

from grpo_trainer.rollout.fast.sampling import sample_from_probs
from grpo_trainer.rollout.speculative.verify import committed_counts

EOS = torch.tensor([9])


@pytest.mark.parametrize(("drawn", "drafts", "length", "expected"), [
    ([5, 6, 9], [5, 7], 2, 2),  # 5 held, 6 != 7 committed: two tokens
    ([5, 7, 3], [5, 7], 2, 3),  # both held, then the bonus token
    ([4, 7, 3], [5, 7], 2, 1),  # the first draw differs: one token, as without a draft
    ([5, 7, 3], [5, 7], 1, 2),  # only one token drafted: its draw, then the next one's
    ([5, 7, 3], [5, 7], 0, 1),  # no draft: one token
    ([9, 7, 3], [9, 7], 2, 1),  # a drafted EOS that is drawn ends the completion there
    ([5, 9, 3], [5, 9], 2, 2),
])
def test_committed_counts_by_hand(drawn, drafts, length, expected):
    counts = committed_counts(torch.tensor([drawn]), torch.tensor([drafts]), torch.tensor([length]), EOS)
    assert counts.tolist() == [expected]


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _two_tokens(rule: str, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint counts `[V, V]` of the first two committed tokens, drafting (d1, d2) with a synthetic target: p1 over
    the first token, p2[x] over the second given the first. Each position's token reads its own uniforms, as the
    loop's do (`speculative.loop`, decision 1)."""
    generator = torch.Generator().manual_seed(seed)
    V = 5
    p1 = torch.softmax(torch.randn(V, generator=generator, dtype=torch.float64), 0)
    p2 = torch.softmax(torch.randn(V, V, generator=generator, dtype=torch.float64), 1)
    d1, d2 = 2, 3  # a fixed point-mass draft
    u = torch.rand((draws, 2, 2), generator=generator, dtype=torch.float64)
    # One verifying forward: logits after the last token (for x1), after d1 (for x2), after d2 (bonus, unused).
    x1 = sample_from_probs(p1.expand(draws, V), u=u[:, 0])
    x2_if_held = sample_from_probs(p2[d1].expand(draws, V), u=u[:, 1])
    drawn = torch.stack([x1, x2_if_held, torch.zeros_like(x1)], 1)
    m = committed_counts(drawn, torch.tensor([[d1, d2]]).expand(draws, 2), torch.full((draws,), 2), EOS)
    if rule == "exact":  # a rejected first token is itself committed; the next forward draws x2 given it
        x2_next = sample_from_probs(p2[x1], u=u[:, 1])
    else:  # SPEC-RL#14's rule: after a rejection, the committed first token is drawn again from the full target
        x1 = torch.where(m == 1, sample_from_probs(p1.expand(draws, V)), x1)
        x2_next = sample_from_probs(p2[x1])
    second = torch.where(m >= 2, x2_if_held, x2_next)
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((x1, second), torch.ones(draws, dtype=torch.float64), accumulate=True)
    return counts, draws * p1[:, None] * p2


@pytest.mark.parametrize("seed", [0, 1])
def test_committed_tokens_follow_the_target_and_the_biased_rule_does_not(seed):
    torch.manual_seed(seed)
    counts, expected = _two_tokens("exact", 100_000, seed)
    # 24 degrees of freedom: the 0.999 quantile of chi-square(24) is 51.2
    assert _chi_square(counts, expected) < 51.2
    assert counts.sum() == 100_000
    counts, expected = _two_tokens("first_rejection_resamples", 100_000, seed)
    assert _chi_square(counts, expected) > 200  # biased: the first token's rejected mass is drawn again
    assert math.isfinite(_chi_square(counts, expected))
