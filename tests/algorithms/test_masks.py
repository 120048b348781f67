"""The off-policy sequence mask and the high-entropy token mask against hand-derived numbers."""

import math

import torch

from grpo_trainer.algorithms.masks import high_entropy_mask, off_policy_mask


def test_off_policy_mask_keeps_positive_or_close_completions():
    # drift = mean over active tokens of (sampling - current); threshold 1.0
    #   row 0: A = +1, drift 0 - (-2) = 2   -> kept (positive advantage)
    #   row 1: A = -1, drift 0.5            -> kept (close enough)
    #   row 2: A = -1, drift 2              -> dropped
    #   row 3: A = 0,  drift 2              -> kept (A >= 0)
    #   row 4: A = -1, drift exactly 1.0    -> kept (<= threshold)
    sampling = torch.zeros(5, 2)
    logps = torch.tensor([[-2.0, -2.0], [-0.5, -0.5], [-2.0, -2.0], [-2.0, -2.0], [-1.5, -0.5]])
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [0.0], [-1.0]])
    kept = off_policy_mask(advantages, logps, sampling, torch.ones(5, 2), 1.0)
    assert kept.tolist() == [[1.0], [1.0], [0.0], [1.0], [1.0]] and kept.dtype == torch.float32


def test_off_policy_mask_reads_only_active_tokens_and_skips_unscored_ones():
    # Active tokens drift 2 and 2 -> mean 2 > 1: dropped; the padding's huge values are not read.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    logps = torch.tensor([[-2.0, -2.0, -1e4, 1e4]])
    assert off_policy_mask(torch.tensor([-1.0]), logps, torch.zeros(1, 4), mask, 1.0).tolist() == [[0.0]]
    # A NaN sampling log-prob (a token the sampler could not score) counts as no drift: (0 + 2) / 2 = 1 <= 1: kept
    sampling = torch.tensor([[math.nan, 0.0, 0.0, 0.0]])
    assert off_policy_mask(torch.tensor([-1.0]), logps, sampling, mask, 1.0).tolist() == [[1.0]]
    # the mask's dtype is kept (TRL's), here an integer mask
    assert off_policy_mask(torch.tensor([1.0]), logps, torch.zeros(1, 4), mask.int(), 1.0).dtype == torch.int32


def test_off_policy_mask_is_not_differentiated():
    logps = torch.zeros(1, 2, requires_grad=True)
    assert not off_policy_mask(torch.tensor([-1.0]), logps, torch.zeros(1, 2), torch.ones(1, 2), 0.5).requires_grad


def test_high_entropy_mask_by_hand():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])  # the 7.0 and 9.0 are padding: never kept
    # pooled (the valid entropies) sorted: 0.1 0.2 0.3 0.5 0.7 0.9; the 0.5 quantile (linear) is
    # 0.3 + 0.5 * (0.5 - 0.3) = 0.4: keep 0.9, 0.5, 0.7
    pooled = entropy[mask.bool()]
    kept = high_entropy_mask(entropy, mask, pooled, 0.5)
    assert kept.dtype == torch.bool
    assert kept.int().tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    # level 0 keeps every valid token; level 1 only the largest (0.9)
    assert high_entropy_mask(entropy, mask, pooled, 0.0).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert high_entropy_mask(entropy, mask, pooled, 1.0).int().tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]


def test_high_entropy_mask_takes_the_quantile_over_the_pooled_entropies():
    # Another process's entropies 2.0 and 3.0 join the pool 0.1 0.9: sorted 0.1 0.9 2 3, the 0.5 quantile is
    # 0.9 + 0.5 * (2 - 0.9) = 1.45: no local token reaches it (alone, the threshold would be 0.5: 0.9 kept).
    entropy, mask = torch.tensor([[0.1, 0.9]]), torch.ones(1, 2)
    assert high_entropy_mask(entropy, mask, torch.tensor([0.1, 0.9, 2.0, 3.0]), 0.5).tolist() == [[False, False]]
    assert high_entropy_mask(entropy, mask, torch.tensor([0.1, 0.9]), 0.5).tolist() == [[False, True]]
    # nothing pooled: nothing kept
    assert not high_entropy_mask(entropy, mask, torch.zeros(0), 0.5).any()
