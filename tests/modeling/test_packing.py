"""The packing plan and layout, worked out by hand: first-fit decreasing, packed tokens and positions, where each
scored token is predicted from and where its result goes back."""

import pytest
import torch

from grpo_trainer.modeling.packing import PackedBatch, PackingCost, PackingSettings, first_fit_decreasing, plan


def test_first_fit_decreasing_by_hand():
    # lengths 3 5 2 4 1, budget 6. Longest first: 5 (index 1) -> row 0 [5]; 4 (3) does not fit row 0 (9 > 6)
    # -> row 1 [4]; 3 (0) fits neither (8, 7) -> row 2 [3]; 2 (2) -> row 1 (6); 1 (4) -> row 0 (6).
    assert first_fit_decreasing([3, 5, 2, 4, 1], 6) == [[1, 4], [3, 2], [0]]
    # Ties keep index order; a length over the budget gets a row of its own.
    assert first_fit_decreasing([2, 2, 2], 4) == [[0, 1], [2]]
    assert first_fit_decreasing([7, 1], 4) == [[0], [1]]
    assert first_fit_decreasing([], 4) == []
    # A row too full for the shortest sequence is no longer scanned, and first fit still finds earlier rows' room:
    # 6 -> row 0 (room 4); 5 -> row 1 (5); 4 -> row 0 (0, closed); 3 -> row 1 (2); 2 -> row 1 (0); 2 -> row 2.
    assert first_fit_decreasing([2, 3, 6, 4, 5, 2], 10) == [[2, 3], [4, 1, 0], [5]]


def test_plan_weighs_filler_against_dense_attention_by_hand():
    # Lengths 5, 4, 3. Budgets 5, 7, 10 (1, 1.5, 2 x the longest; 3 x and more reach the total) and 12 (everything)
    # give rows [0] [1] [2] (width 5), [0] [1 2] (7), [0 1] [2] (9), [0 1 2] (12).
    # Cost R x (token x W + pair x W^2). Without a pair cost (varlen attention): 15, 14, 18, 12: one row.
    assert plan([5, 4, 3], PackingSettings(cost=PackingCost(1.0, 0.0))) == ([[0, 1, 2]], 12)
    # With pair = 1: 3 x (5 + 25) = 90, 2 x (7 + 49) = 112, 2 x (9 + 81) = 180, 12 + 144 = 156: rows of 5.
    assert plan([5, 4, 3], PackingSettings(cost=PackingCost(1.0, 1.0))) == ([[0], [1], [2]], 5)
    # A given budget is used as is; widths round up to pad_to_multiple_of.
    assert plan([5, 4, 3], PackingSettings(token_budget=7, pad_to_multiple_of=4)) == ([[0], [1, 2]], 8)
    assert plan([], PackingSettings()) == ([[]], 1)


def _batch():
    """3 rows, S = 3, T = 3. Row 0: prompt [11, 12], completion [13, 14, 15]; row 1: prompt [21, 22, 23],
    completion [24]; row 2: prompt [31], completion [32, 33]. 0 is padding."""
    ids = torch.tensor([[0, 11, 12, 13, 14, 15],
                        [21, 22, 23, 24, 0, 0],
                        [0, 0, 31, 32, 33, 0]])
    return ids, (ids != 0).long()


def test_layout_by_hand():
    ids, mask = _batch()
    packed = PackedBatch.of(ids, mask, completion_length=3, settings=PackingSettings(token_budget=5))
    # Lengths 5, 4, 3; a budget of 5: [row 0], [row 1], [row 2] (4 + 3 > 5): nothing shares a row here,
    # but each row is only as wide as the longest sequence (5 instead of 6), the rest filler. With one sequence per
    # row the filler continues the row's positions: each row is one causal sequence (no dense mask needed).
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 0], [31, 32, 33, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # Scored: row 0's 13 14 15 (completion columns 0 1 2), row 1's 24 (column 0), row 2's 32 33 (columns 0 1);
    # each predicted by the packed cell before it: flat indices 1 2 3 | 5 + 2 | 10 + 0, 10 + 1.
    assert packed.tokens.tolist() == [13, 14, 15, 24, 32, 33]
    assert packed.predictors.tolist() == [1, 2, 3, 7, 10, 11]
    assert packed.targets.tolist() == [0, 1, 2, 3, 6, 7]  # b * T + t
    assert packed.tokens_computed == 15 < ids.numel() == 18 and packed.real_tokens == 12
    assert packed.sources[0].tolist() == [[0] * 5, [1, 1, 1, 1, 0], [2, 2, 2, 0, 0]]
    assert packed.sources[1].tolist() == [[1, 2, 3, 4, 5], [0, 1, 2, 3, 0], [2, 3, 4, 0, 0]]
    assert packed.sequence_lengths == (5, 4, 1, 3, 2)


def test_budget_shares_rows_and_rows_without_completion_are_left_out():
    ids, mask = _batch()
    mask[1, 3] = 0  # row 1's completion masked (e.g. a truncated completion under mask_truncated_completions)
    packed = PackedBatch.of(ids, mask, 3, PackingSettings(token_budget=8))
    # Rows 0 (5 tokens) and 2 (3 tokens) share one row of 8; row 1 is not packed.
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 31, 32, 33]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert packed.predictors.tolist() == [1, 2, 3, 5, 6]  # 32 from 31 (cell 5), not from 15 (cell 4)
    assert packed.targets.tolist() == [0, 1, 2, 6, 7]
    values = torch.arange(1.0, 6.0)
    assert packed.scatter(values).tolist() == [[1, 2, 3], [0, 0, 0], [4, 5, 0]]
    assert packed.gather(torch.arange(9.0).view(3, 3)).tolist() == [0, 1, 2, 6, 7]


def test_one_row_and_flash_kwargs():
    ids, mask = _batch()
    packed = PackedBatch.of(ids, mask, 3, PackingSettings(token_budget=12, pad_to_multiple_of=8))
    # 5 + 4 + 3 = 12 tokens in one row, rounded up to 16: a filler sequence of 4.
    assert packed.input_ids.shape == (1, 16)
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]
    kwargs = packed.flash_kwargs()
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 5, 9, 12, 16] and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 5


@pytest.mark.parametrize("seed", range(5))
def test_random_layouts_put_every_real_token_once(seed):
    """Any masks: each real token of a row with a completion appears once, in order, positions 0..n-1; the scored
    tokens are exactly the real completion tokens after another real token."""
    generator = torch.Generator().manual_seed(seed)
    B, S, T = 7, 5, 6
    prompt = torch.randint(1, S + 1, (B,), generator=generator)
    completion = torch.randint(0, T + 1, (B,), generator=generator)
    columns = torch.arange(S + T)
    mask = ((columns >= S - prompt[:, None]) & (columns < S + completion[:, None])).long()
    ids = torch.randint(1, 100, (B, S + T), generator=generator) * mask
    budget = int(torch.randint(1, 20, (), generator=generator))
    packed = PackedBatch.of(ids, mask, T, PackingSettings(token_budget=budget))
    rows = packed.sources[0]
    for b in range(B):
        cells = (rows == b) & (packed.position_ids >= 0) & (packed.input_ids != 0)
        got = packed.input_ids[cells].tolist()
        assert got == (ids[b][mask[b].bool()].tolist() if completion[b] > 0 else [])
    expected = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        expected[b, :completion[b]] = True
    assert packed.scatter(torch.ones(packed.tokens.numel())).bool().equal(expected)
    assert packed.tokens.tolist() == ids[:, S:][expected].tolist()
    flat = packed.input_ids.reshape(-1)
    assert torch.equal(flat[packed.predictors + 1], packed.tokens)  # the predictor is the cell before
