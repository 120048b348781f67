"""The policy surrogates against hand-derived numbers and autograd.

Notation: rho = pi_theta / pi_old (the importance ratio), A the advantage, eps the clip range, w VESPO's
sequence ratio and phi(w) its Gamma weight.
"""

import math

import pytest
import torch

from grpo_trainer.algorithms.surrogates import (
    SURROGATES,
    SurrogateParams,
    cispo_surrogate,
    clipped_surrogate,
    gamma_weights,
    sapo_surrogate,
    vespo_surrogate,
)
from tests.algorithms.numeric import F64, close, t


def surrogate_at(fn, ratios, advantages, logps=None, **params):
    """Per-token surrogate for one row of ratios `[T]` and per-token advantages `[T]`, its metric tensors, and
    d loss / d log rho."""
    log_ratio = torch.log(t(ratios)).unsqueeze(0).requires_grad_(True)  # [1, T]
    adv = t(advantages).unsqueeze(0)
    logps = torch.zeros_like(log_ratio) if logps is None else t(logps).unsqueeze(0)
    loss, flags = fn(log_ratio, log_ratio, adv, logps, torch.ones_like(logps), SurrogateParams(**params))
    (grad,) = torch.autograd.grad(loss.sum(), log_ratio, allow_unused=True)
    return loss[0], {k: v[0] for k, v in flags.items()}, (torch.zeros_like(log_ratio) if grad is None else grad)[0]


def test_registry_names():
    assert SURROGATES == {"clip": clipped_surrogate, "cispo": cispo_surrogate, "sapo": sapo_surrogate,
                          "vespo": vespo_surrogate}


# ---------------------------------------------------------------------------------------------------------------
# Clipped surrogate (PPO)
# ---------------------------------------------------------------------------------------------------------------


def test_clipped_surrogate_four_quadrants():
    # eps = 0.2, band [0.8, 1.2]; loss = -min(rho A, clip(rho) A)
    #   rho 1.5, A=+1: -min(1.5, 1.2)    = -1.2   (clipped high: no gradient)
    #   rho 0.5, A=+1: -min(0.5, 0.8)    = -0.5   (unclipped: pessimistic side)
    #   rho 1.5, A=-1: -min(-1.5, -1.2)  = 1.5    (unclipped)
    #   rho 0.5, A=-1: -min(-0.5, -0.8)  = 0.8    (clipped low: no gradient)
    #   rho 1.1, A=+2: inside the band   = -2.2
    #   rho 0.9, A=-3: inside the band   = 2.7
    loss, clip, grad = surrogate_at(clipped_surrogate, [1.5, 0.5, 1.5, 0.5, 1.1, 0.9], [1, 1, -1, -1, 2, -3])
    close(loss, [-1.2, -0.5, 1.5, 0.8, -2.2, 2.7])
    assert clip["clip_ratio/high_mean"].tolist() == [True, False, False, False, False, False]
    assert clip["clip_ratio/low_mean"].tolist() == [False, False, False, True, False, False]
    assert clip["clip_ratio/region_mean"].tolist() == [True, False, False, True, False, False]
    # d(-rho A)/d log rho = -rho A where unclipped, 0 where clipped:
    #   [0, -0.5, 1.5, 0, -1.1*2 = -2.2, 0.9*3 = 2.7]
    close(grad, [0.0, -0.5, 1.5, 0.0, -2.2, 2.7])


def test_clip_higher_is_asymmetric():
    # eps_low 0.2, eps_high 0.28: band [0.8, 1.28]
    #   rho 1.25, A=+1: inside now (a symmetric 0.2 would clip to 1.2) -> -1.25
    #   rho 1.5,  A=+1: clipped at 1.28                                 -> -1.28
    #   rho 0.7,  A=-1: clipped at the unchanged low end 0.8            -> -min(-0.7, -0.8) = 0.8
    loss, clip, _ = surrogate_at(clipped_surrogate, [1.25, 1.5, 0.7], [1, 1, -1], epsilon_high=0.28)
    close(loss, [-1.25, -1.28, 0.8])
    assert clip["clip_ratio/high_mean"].tolist() == [False, True, False]
    assert clip["clip_ratio/low_mean"].tolist() == [False, False, True]
    symmetric, _, _ = surrogate_at(clipped_surrogate, [1.25], [1])
    close(symmetric, [-1.2])


def test_delta_caps_the_unclipped_ratio():
    # delta 1.4 (two-sided clipping): for A < 0 the unclipped branch is min(rho, 1.4) A.
    #   rho 2.0, A=-1: -min(-1.4, -1.2) = 1.4    (without delta: -min(-2.0, -1.2) = 2.0)
    #   rho 2.0, A=+1: -min(1.4, 1.2)   = -1.2   (unchanged: the upper clip already binds)
    #   rho 1.3, A=-1: under delta      = 1.3
    loss, clip, grad = surrogate_at(clipped_surrogate, [2.0, 2.0, 1.3], [-1, 1, -1], delta=1.4)
    close(loss, [1.4, -1.2, 1.3])
    close(grad, [0.0, 0.0, 1.3])  # the capped token has no gradient; the one under the cap has -rho A = 1.3
    no_delta, _, _ = surrogate_at(clipped_surrogate, [2.0], [-1])
    close(no_delta, [2.0])
    # The high-clip flag is read on the capped ratio, as TRL counts it: with delta 1.1 < 1 + eps_high = 1.2 a ratio
    # of 2.0 with A > 0 is capped to 1.1 and so never counted as high-clipped (1.3 > 1.2 with A < 0: not high).
    _, clip, _ = surrogate_at(clipped_surrogate, [2.0, 1.3], [1, -1], delta=1.1)
    assert clip["clip_ratio/high_mean"].tolist() == [False, False]


def test_sequence_level_flags_keep_their_shape():
    # One ratio per sequence [B, 1] with A [B, 1]: the flags are per sequence, [B, 1], not spread over tokens.
    log_ratio = torch.log(t([[1.5], [0.5]]))
    loss, flags = clipped_surrogate(log_ratio, torch.zeros(2, 3, dtype=F64), t([[1.0], [-1.0]]),
                                    torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64), SurrogateParams())
    assert loss.shape == (2, 3) and flags["clip_ratio/high_mean"].shape == (2, 1)
    close(loss, [[-1.2] * 3, [0.8] * 3])


# ---------------------------------------------------------------------------------------------------------------
# CISPO and SAPO
# ---------------------------------------------------------------------------------------------------------------


def test_cispo_per_token_values_and_gradient():
    # loss = -sg(min(rho, cap)) A logp, cap = epsilon_high = 1.2
    #   rho 1.5, A=+2, logp -0.5: -1.2 * 2 * -0.5  = 1.2   (weight capped; counted in cispo_clip_ratio)
    #   rho 0.5, A=-1, logp -2.0: -0.5 * -1 * -2.0 = -1.0  (no lower cap in CISPO)
    #   rho 1.0, A=+3, logp -1.0: -1.0 * 3 * -1.0  = 3.0
    logps = t([[-0.5, -2.0, -1.0]]).requires_grad_(True)
    old = logps.detach() - torch.log(t([[1.5, 0.5, 1.0]]))
    loss, flags = cispo_surrogate(logps - old, logps - old, t([[2.0, -1.0, 3.0]]), logps, torch.ones(1, 3),
                                  SurrogateParams(epsilon_high=1.2))
    close(loss, [[1.2, -1.0, 3.0]])
    assert flags.keys() == {"cispo_clip_ratio"} and flags["cispo_clip_ratio"].tolist() == [[True, False, False]]
    # Every token keeps a gradient, and the weight is a constant: d/d logp = -w A = [-1.2*2, -0.5*-1, -1*3]
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    close(grad, [[-2.4, 0.5, -3.0]])


def test_sapo_per_token_values():
    # loss = -(4 / tau) sigmoid(tau (rho - 1)) A, tau = 1.0 for A > 0, 1.05 for A < 0
    #   rho 1.5, A=+1: -4 * sigmoid(0.5) = -4 * 0.622459 = -2.489837
    #   rho 0.5, A=-1: (4 / 1.05) * sigmoid(-0.525) = 3.809524 * 0.371684 = 1.415939
    #   rho 1.0, A=+2: -4 * 0.5 * 2 = -4.0
    loss, flags, _ = surrogate_at(sapo_surrogate, [1.5, 0.5, 1.0], [1, -1, 2])
    close(loss, [-2.489837, 1.415939, -4.0])
    assert flags == {}  # TRL logs no clip metric for SAPO
    loss, _, _ = surrogate_at(sapo_surrogate, [1.5], [1], sapo_temperature_pos=2.0)
    close(loss, [-2 * 1 / (1 + math.exp(-1.0))])  # -(4/2) sigmoid(2 * 0.5) = -2 * 0.731059 = -1.462117


@pytest.mark.parametrize("advantage", [1.5, -0.7])
def test_sapo_gradient_at_ratio_one_matches_unclipped(advantage):
    # d/d log rho [-(4/tau) sigmoid(tau (rho - 1)) A] at rho = 1 = -(4/tau) * (1/4) * tau * 1 * A = -A
    _, _, grad = surrogate_at(sapo_surrogate, [1.0], [advantage])
    close(grad, [-advantage])


# ---------------------------------------------------------------------------------------------------------------
# VESPO
# ---------------------------------------------------------------------------------------------------------------


def test_gamma_weights_by_hand():
    # phi(w) = exp(lam + k log w - lam w); (k, lam) = (2, 3) for A >= 0, (3, 2) for A < 0.
    #   row 0: token log-ratios 0.1, 0.2 (third masked) -> log w = 0.3, w = e^0.3 = 1.349859, A = +1:
    #          3 + 2 * 0.3 - 3 * 1.349859 = -0.449576 -> phi = 0.637898
    #   row 1: log w = -0.5 (one token), w = 0.606531, A = -1:
    #          2 + 3 * -0.5 - 2 * 0.606531 = -0.713061 -> phi = 0.490141
    #   row 2: log w = 0 (w = 1), A = 0 (the `_pos` pair): 3 + 0 - 3 = 0 -> phi(1) = 1
    log_ratio = t([[0.1, 0.2, 9.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    phi = gamma_weights(t([[1.0], [-1.0], [0.0]]), log_ratio, mask)
    close(phi, [[math.exp(3 + 0.6 - 3 * math.exp(0.3))], [math.exp(2 - 1.5 - 2 * math.exp(-0.5))], [1.0]])
    close(phi, [[0.637898], [0.490141], [1.0]])


def test_gamma_weights_clamps_and_sampler_correction():
    # A token log-ratio of 50 is clamped to 20 before the sum: log w = 20 + 20 = 40 -> clamped to 20; phi =
    # exp(3 + 40 - 3 e^20) underflows to 0. A log-ratio of -50 -> log w clamped to ln 1e-8 = -18.420681:
    # phi = exp(2 + 3 * -18.420681 - 2e-8) = exp(-53.262043) = 7.389056e-24 (A < 0).
    phi = gamma_weights(t([[1.0], [-1.0]]), t([[50.0, 50.0], [-50.0, 0.0]]), torch.ones(2, 2, dtype=F64))
    close(phi[0], [0.0])
    assert phi[1, 0].item() == pytest.approx(math.exp(2 + 3 * math.log(1e-8) - 2 * 1e-8), rel=1e-9)
    # The sampler-correction ratios multiply w (summed in log space, over every column): log w = 0 + ln 2 + ln 1
    # = ln 2, w = 2, A = +1: phi = exp(3 + 2 ln 2 - 6) = 4 e^-3 = 0.199148
    phi = gamma_weights(t([[1.0]]), t([[0.0, 0.0]]), t([[1, 1]]), importance_sampling_ratio=t([[2.0, 1.0]]))
    close(phi, [[4 * math.exp(-3)]])


def test_vespo_surrogate_values_and_gradient():
    # Row ratios w = e^0.3 (A = +1, phi 0.637898) and e^-0.5 (A = -2, phi 0.490141) as above;
    # loss = -phi A log pi per token; logps -1, -2 | -0.5: [0.637898 * -1 ... ] -> row 0: -0.637898 * 1 * [-1, -2]
    # = [0.637898, 1.275797]; row 1: -0.490141 * -2 * [-0.5, *] = [-0.490141, ...]
    logps = t([[-1.0, -2.0], [-0.5, -3.0]]).requires_grad_(True)
    token_log_ratio = t([[0.1, 0.2], [-0.5, 0.0]])
    mask = t([[1, 1], [1, 0]])
    loss, flags = vespo_surrogate(token_log_ratio, token_log_ratio, t([[1.0], [-2.0]]), logps, mask,
                                  SurrogateParams())
    close(loss[0], [0.637898, 1.275797])
    close(loss[1, 0], -0.490141)
    close(flags["vespo/phi_seq_mean"], [[0.637898], [0.490141]])
    # phi is a constant in the gradient: d/d logp = -phi A = [-0.637898, -0.637898], [0.980283, 0.980283]
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    close(grad, [[-0.637898, -0.637898], [0.980283, 0.980283]])


def test_vespo_uses_token_ratios_whatever_the_level():
    # The `log_ratio` argument (here a sequence-level [B, 1] one that would give another w) is not read.
    token_log_ratio = t([[0.1, 0.2]])
    args = (t([[1.0]]), t([[-1.0, -2.0]]), t([[1, 1]]), SurrogateParams())
    a, _ = vespo_surrogate(token_log_ratio, token_log_ratio, *args)
    b, _ = vespo_surrogate(t([[5.0]]), token_log_ratio, *args)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# The inference engine's importance weight (engine_ratio)
# ---------------------------------------------------------------------------------------------------------------


def test_engine_ratio_scales_the_token_loss_of_every_surrogate_but_vespo():
    # On-policy tokens (log rho 0), A = +1, logps -1, epsilon_high 5 (CISPO's cap): clip -min(1, 1) = -1, cispo
    # -min(1, 5) * 1 * -1 = 1,
    # sapo -(4 / 1) sigmoid(0) = -2; times engine weights [0.5, 2.0] -> [-0.5, -2], [0.5, 2], [-1, -4]
    zero, adv, logps, mask = t([[0.0, 0.0]]), t([[1.0]]), t([[-1.0, -1.0]]), t([[1, 1]])
    weights = t([[0.5, 2.0]])
    for fn, expected in ((clipped_surrogate, [-0.5, -2.0]), (cispo_surrogate, [0.5, 2.0]),
                         (sapo_surrogate, [-1.0, -4.0])):
        params = SurrogateParams(epsilon_high=5.0)
        loss, flags = fn(zero, zero, adv, logps, mask, params, weights)
        close(loss[0], expected)
        _, same_flags = fn(zero, zero, adv, logps, mask, params)
        assert flags.keys() == same_flags.keys() and all(torch.equal(flags[k], same_flags[k]) for k in flags)


def test_engine_ratio_enters_vespo_through_its_sequence_weight():
    # On-policy log w = 0, engine weights [2, 1]: log w = ln 2, w = 2, A = +1: phi = exp(3 + 2 ln 2 - 6) = 4 e^-3
    # = 0.199148; loss = -phi A logp = 0.199148 * [1, 1] (logps -1): the weight is not also multiplied in.
    zero = t([[0.0, 0.0]])
    loss, flags = vespo_surrogate(zero, zero, t([[1.0]]), t([[-1.0, -1.0]]), t([[1, 1]]), SurrogateParams(),
                                  t([[2.0, 1.0]]))
    close(loss[0], [4 * math.exp(-3), 4 * math.exp(-3)])
    close(flags["vespo/phi_seq_mean"], [[4 * math.exp(-3)]])
