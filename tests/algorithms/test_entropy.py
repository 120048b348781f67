"""The entropy bonus and its coefficient (static and adaptive) against hand-derived numbers, and the bonus in
every loss type: it equals entropy_coef x mean entropy, whatever the aggregation (TRL's test_entropy_bonus_scale,
here exact)."""

import math

import pytest
import torch

from grpo_trainer.algorithms.entropy import EntropyControl, entropy_bonus, window_stats
from grpo_trainer.algorithms.losses import LOSS_TYPES, LossNorm, policy_loss
from tests.algorithms.numeric import F64, t


def test_entropy_bonus_and_window_stats_by_hand():
    entropy, mask = t([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]), t([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3 tokens = 7/3; over 2 accumulation steps 7/6
    assert entropy_bonus(entropy, mask).item() == pytest.approx(7 / 3)
    assert entropy_bonus(entropy, mask, accumulation_steps=2).item() == pytest.approx(7 / 6)
    assert window_stats(entropy, mask).tolist() == [7.0, 3.0]
    assert entropy_bonus(entropy, torch.zeros(2, 3)).item() == 0.0  # no token: 0 / clamp(0, 1)


def test_static_coefficient():
    control = EntropyControl(coef=0.1)
    assert control.enabled and control.applied() == 0.1
    assert not EntropyControl(coef=0.0).enabled


def test_adaptive_coefficient_by_hand():
    # target 0.5, step 0.1, bounds [0, 0.25], start 0.1
    control = EntropyControl(coef=0.1, adaptive=True, target=0.5, step=0.1, coef_min=0.0, coef_max=0.25)
    assert control.enabled and control.applied() == 0.0  # no measurement yet: no bonus in the first window
    control.update(0.4)  # at or below target: up one step -> 0.2, and the next window applies it
    assert control.coef == pytest.approx(0.2) and control.applied() == pytest.approx(0.2)
    control.update(0.5)  # equal to target counts as below: 0.3 -> capped at 0.25
    assert control.coef == pytest.approx(0.25) and control.applied() == pytest.approx(0.25)
    control.update(0.9)  # above target: down one step -> 0.15, but the bonus is off while above the target
    assert control.coef == pytest.approx(0.15) and control.applied() == 0.0
    control.update(0.9), control.update(0.9)  # 0.05, then floored at 0
    assert control.coef == 0.0
    assert EntropyControl(coef=0.0, adaptive=True).enabled  # adaptive control may raise a zero coefficient


def test_state_round_trip_uses_trls_keys():
    control = EntropyControl(coef=0.3, adaptive=True, last_entropy=0.7)
    state = control.state_dict()
    assert state == {"entropy_coef": 0.3, "last_world_entropy": 0.7}
    restored = EntropyControl(coef=0.01, adaptive=True)
    restored.load_state_dict(state)
    assert (restored.coef, restored.last_entropy) == (0.3, 0.7)
    fresh = EntropyControl(adaptive=True).state_dict()
    assert fresh["last_world_entropy"] == math.inf


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_entropy_contribution_is_coef_times_mean_entropy_for_every_loss_type(loss_type):
    """loss(with bonus) = loss(without) - c * mean entropy / accumulation steps, and the `policy_loss` metric is
    the policy term before the accumulation division (TRL's). Mean entropy over the 3 active tokens:
    (0.5 + 1.5 + 2.5) / 3 = 1.5; c = 0.4, 2 accumulation steps: -0.4 * 1.5 / 2 = -0.3."""
    logps, old = t([[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.2]]), t([[-1.1, -1.8, -0.5], [-0.2, -0.9, -0.2]])
    mask, advantages = t([[1, 1, 0], [1, 0, 0]]), t([0.7, -1.2])
    entropy = t([[0.5, 1.5, 9.0], [2.5, 9.0, 9.0]]).requires_grad_(True)
    norm = LossNorm(accumulation_steps=2, window_tokens=3.0, max_completion_length=3)
    kwargs = {"loss_type": loss_type, "old_logps": old, "ref_logps": old + 0.1, "beta": 0.05}
    plain = policy_loss(logps, advantages, mask, norm, **kwargs)
    bonus = policy_loss(logps, advantages, mask, norm, entropy=entropy, entropy_coef=0.4, **kwargs)
    assert (bonus.loss - plain.loss).item() == pytest.approx(-0.3, abs=1e-12)
    # policy_loss: the dapo family's window normaliser already spans the window; the others are x 2 steps
    factor = 1 if LOSS_TYPES[loss_type][1] == "dapo" else 2
    assert bonus.metrics["policy_loss"].item() == pytest.approx(factor * plain.loss.item(), abs=1e-12)
    assert "policy_loss" not in plain.metrics
    # d loss / d H = -c / (3 tokens * 2 steps) = -0.4 / 6 on active tokens, 0 elsewhere
    (grad,) = torch.autograd.grad(bonus.loss, entropy)
    torch.testing.assert_close(grad, t([[-0.4 / 6, -0.4 / 6, 0.0], [-0.4 / 6, 0.0, 0.0]]), atol=1e-12, rtol=0)


def test_entropy_bonus_acts_on_the_high_entropy_tokens_only():
    # entropy mask keeps tokens 1 and 2 of row 0: mean (1.5 + 2.5) / 2 = 2; c = 1, 1 step: contribution -2.
    # The mask also zeroes the surrogate of the other tokens but not the normalisers (TRL): on-policy A = 1,
    # grpo: row 0 tokens -1 * [0, 1, 1] / 3 active = -2/3, row 1 none kept -> 0 / 1 = 0; mean -1/3.
    logps, mask = torch.zeros(2, 3, dtype=F64), t([[1, 1, 1], [1, 0, 0]])
    entropy = t([[0.5, 1.5, 2.5], [0.1, 0.0, 0.0]])
    entropy_mask = torch.tensor([[False, True, True], [False, False, False]])
    out = policy_loss(logps, t([1.0, 1.0]), mask, LossNorm(), loss_type="grpo", entropy_mask=entropy_mask,
                      entropy=entropy, entropy_coef=1.0)
    assert out.metrics["policy_loss"].item() == pytest.approx(-1 / 3)
    assert out.loss.item() == pytest.approx(-1 / 3 - 2.0)


def test_entropy_coef_needs_the_entropy():
    with pytest.raises(ValueError, match="entropy_coef needs entropy"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), LossNorm(), entropy_coef=0.1)
