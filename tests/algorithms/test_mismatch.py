"""The mismatch report's pure parts: position buckets, the per-token table, the worst tokens, the cause rules."""

import math

import torch

from grpo_trainer.algorithms.mismatch import (
    MismatchFacts,
    bucket_name,
    likely_cause,
    position_buckets,
    token_table,
    worst_tokens,
)

NAN = math.nan


def test_position_buckets_by_hand():
    # 2 rows x 20 positions; |delta| = 0.1 at positions 0-15 and 0.5 at 16-19 of row 0; row 1 has 3 tokens (0.3,
    # NaN, 0.2) then padding. Bucket 0-15: 16 x 0.1 + 0.3 + 0.2 = 2.1 over 18 tokens (the NaN left out), max 0.3;
    # bucket 16-63: 4 x 0.5 = 2.0 over 4, max 0.5; the others empty.
    delta = torch.zeros(2, 20)
    delta[0, :16], delta[0, 16:] = -0.1, 0.5
    delta[1, :3] = torch.tensor([0.3, NAN, -0.2])
    mask = torch.zeros(2, 20)
    mask[0], mask[1, :3] = 1, 1
    table = position_buckets(delta, mask)
    torch.testing.assert_close(table[0], torch.tensor([2.1, 18.0, 0.3]))
    torch.testing.assert_close(table[1], torch.tensor([2.0, 4.0, 0.5]))
    assert (table[2:] == 0).all()
    assert [bucket_name(k) for k in range(5)] == ["0-15", "16-63", "64-255", "256-1023", "1024+"]


def test_token_table_and_worst_tokens():
    delta = torch.tensor([[0.1, -0.4, 0.2], [0.3, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tokens = torch.tensor([[7, 5, 7], [5, 9, 7]])
    ids, counts, sums, maxima = token_table(delta, mask, tokens)
    # token 5: 0.4 and 0.3; token 7: 0.1 and 0.2 (the masked NaN left out); token 9: 0.0
    assert ids.tolist() == [5, 7, 9] and counts.tolist() == [2, 2, 1]
    torch.testing.assert_close(sums, torch.tensor([0.7, 0.3, 0.0]))
    torch.testing.assert_close(maxima, torch.tensor([0.4, 0.2, 0.0]))
    worst = worst_tokens(delta, mask, 2)
    assert [(r, p) for r, p, _ in worst] == [(0, 1), (1, 0)]
    assert worst[0][2] == torch.tensor(-0.4).item()  # the signed difference
    assert len(worst_tokens(delta, mask, 10)) == 5  # never more than the scored tokens


def _facts(**changes):
    base = dict(mean_delta=0.2, truncated_unmasked=False, mean_cut=0.0, baseline=0.1, weights_changed=True,
                sampler_dtype=torch.float32, trainer_dtype=torch.float32)
    return MismatchFacts(**{**base, **changes})


def test_cause_rules_in_order():
    # truncation explains at least half the difference: it is named first, even with other causes present
    assert likely_cause(_facts(truncated_unmasked=True, mean_cut=0.15, sampler_dtype=torch.bfloat16))[0] == \
        "truncated support"
    # ... but not when it explains little of it
    assert likely_cause(_facts(truncated_unmasked=True, mean_cut=0.05, baseline=0.01))[0] == "stale weights"
    # grown past 10x the first round's (0.2 > 10 x 0.01) after an update
    assert likely_cause(_facts(baseline=0.01))[0] == "stale weights"
    assert likely_cause(_facts(baseline=0.01, weights_changed=False))[0] == "kernel difference"
    assert likely_cause(_facts(baseline=0.03))[0] == "kernel difference"  # 0.2 < 10 x 0.03
    name, why = likely_cause(_facts(baseline=0.03, sampler_dtype=torch.bfloat16))
    assert name == "dtype" and "torch.bfloat16" in why and "torch.float32" in why
    assert likely_cause(_facts(sampler_dtype=None, baseline=None))[0] == "kernel difference"
