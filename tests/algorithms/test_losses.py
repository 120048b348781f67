"""Policy-loss math against hand-derived numbers, autograd and gradcheck.

Notation: rho = pi_theta / pi_old (the importance ratio), A the advantage, eps the clip range.
"""

import math

import pytest
import torch

from grpo_trainer.algorithms.losses import (
    AGGREGATIONS,
    LOSS_TYPES,
    LossNorm,
    cispo_surrogate,
    clipped_surrogate,
    kl_k3,
    log_importance_ratio,
    policy_loss,
    sapo_surrogate,
)

ATOL = 1e-6
F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected) -> None:
    expected = expected if isinstance(expected, torch.Tensor) else t(expected)
    torch.testing.assert_close(actual.detach().to(F64), expected.to(F64), atol=ATOL, rtol=0)


def surrogate_at(fn, ratios, advantages, logps=None, **kwargs):
    """Per-token surrogate for one row of ratios `[T]` and per-token advantages `[T]`, plus d loss / d log rho."""
    log_ratio = torch.log(t(ratios)).unsqueeze(0).requires_grad_(True)  # [1, T]
    adv = t(advantages).unsqueeze(0)
    logps = torch.zeros_like(log_ratio) if logps is None else t(logps).unsqueeze(0)
    loss, clip = fn(log_ratio, adv, logps, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), log_ratio, allow_unused=True)
    return loss[0], {k: v[0] for k, v in clip.items()}, (torch.zeros_like(log_ratio) if grad is None else grad)[0]


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
    loss, clip, grad = surrogate_at(clipped_surrogate, [1.5, 0.5, 1.5, 0.5, 1.1, 0.9], [1, 1, -1, -1, 2, -3],
                                    epsilon_low=0.2, epsilon_high=0.2)
    close(loss, [-1.2, -0.5, 1.5, 0.8, -2.2, 2.7])
    assert clip["high"].tolist() == [True, False, False, False, False, False]
    assert clip["low"].tolist() == [False, False, False, True, False, False]
    # d(-rho A)/d log rho = -rho A where unclipped, 0 where clipped:
    #   [0, -0.5, 1.5, 0, -1.1*2 = -2.2, 0.9*3 = 2.7]
    close(grad, [0.0, -0.5, 1.5, 0.0, -2.2, 2.7])


def test_clip_higher_is_asymmetric():
    # eps_low 0.2, eps_high 0.28: band [0.8, 1.28]
    #   rho 1.25, A=+1: inside now (a symmetric 0.2 would clip to 1.2) -> -1.25
    #   rho 1.5,  A=+1: clipped at 1.28                                 -> -1.28
    #   rho 0.7,  A=-1: clipped at the unchanged low end 0.8            -> -min(-0.7, -0.8) = 0.8
    loss, clip, _ = surrogate_at(clipped_surrogate, [1.25, 1.5, 0.7], [1, 1, -1], epsilon_low=0.2, epsilon_high=0.28)
    close(loss, [-1.25, -1.28, 0.8])
    assert clip["high"].tolist() == [False, True, False] and clip["low"].tolist() == [False, False, True]
    symmetric, _, _ = surrogate_at(clipped_surrogate, [1.25], [1], epsilon_low=0.2, epsilon_high=0.2)
    close(symmetric, [-1.2])


def test_delta_caps_the_unclipped_ratio():
    # delta 1.4 (two-sided clipping): for A < 0 the unclipped branch is min(rho, 1.4) A.
    #   rho 2.0, A=-1: -min(-1.4, -1.2) = 1.4    (without delta: -min(-2.0, -1.2) = 2.0)
    #   rho 2.0, A=+1: -min(1.4, 1.2)   = -1.2   (unchanged: the upper clip already binds)
    #   rho 1.3, A=-1: under delta      = 1.3
    loss, _, grad = surrogate_at(clipped_surrogate, [2.0, 2.0, 1.3], [-1, 1, -1], epsilon_low=0.2, epsilon_high=0.2,
                                 delta=1.4)
    close(loss, [1.4, -1.2, 1.3])
    close(grad, [0.0, 0.0, 1.3])  # the capped token has no gradient; the one under the cap has -rho A = 1.3
    no_delta, _, _ = surrogate_at(clipped_surrogate, [2.0], [-1], epsilon_low=0.2, epsilon_high=0.2)
    close(no_delta, [2.0])


def test_clip_metrics_through_policy_loss():
    # Token ratios exp(logps - old) with mask [[1,1,1,0],[1,1,0,0]], A = [+1, -1]:
    #   row 0 (A>0): rho = [1.5 (high), 1.0, 0.5 (low side but A>0: none), 3.0 (masked out)]
    #   row 1 (A<0): rho = [0.5 (low), 1.5 (high side but A<0: none)]
    # 5 active tokens: low 1/5 = 0.2, high 1/5 = 0.2, region 0.4
    ratios = t([[1.5, 1.0, 0.5, 3.0], [0.5, 1.5, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.full((2, 4), -1.0, dtype=F64)
    out = policy_loss(old + torch.log(ratios), t([1.0, -1.0]), mask, LossNorm(window_tokens=5.0), old_logps=old)
    close(out.metrics["clip_ratio/low_mean"], 0.2)
    close(out.metrics["clip_ratio/high_mean"], 0.2)
    close(out.metrics["clip_ratio/region_mean"], 0.4)
    assert "kl" not in out.metrics
    # loss (dapo, window 5): tokens -1.2, -1.0, -0.5 | 0.8, 1.5 -> sum -0.4 / 5 = -0.08
    close(out.loss, -0.08)


# ---------------------------------------------------------------------------------------------------------------
# KL (k3) and the importance ratio
# ---------------------------------------------------------------------------------------------------------------


def test_kl_k3_hand_values():
    # r = ref - logp; k3 = e^r - r - 1
    #   logp ln .5, ref ln .25: r = -ln 2 -> 0.5 + 0.693147 - 1 = 0.193147
    #   logp ln .25, ref ln .5: r = ln 2  -> 2 - 0.693147 - 1 = 0.306853
    #   equal: r = 0 -> 1 - 0 - 1 = 0
    logps = torch.log(t([0.5, 0.25, 0.3]))
    ref = torch.log(t([0.25, 0.5, 0.3]))
    close(kl_k3(logps, ref), [0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0])
    close(kl_k3(logps, ref), [0.193147, 0.306853, 0.0])


def test_kl_k3_non_negative_and_zero_at_equality():
    generator = torch.Generator().manual_seed(0)
    a, b = -3 * torch.rand(1000, generator=generator), -3 * torch.rand(1000, generator=generator)
    assert (kl_k3(a, b) >= 0).all()
    assert torch.equal(kl_k3(a, a), torch.zeros(1000))


def test_kl_enters_the_loss_with_beta():
    # On-policy, A = 0: the surrogate is 0, so the loss is beta * mean KL.
    # one token, logp ln .5, ref ln .25: k3 = 0.193147; beta 0.1 -> 0.0193147 (grpo: token mean, sequence mean)
    logps = torch.log(t([[0.5]]))
    out = policy_loss(logps, t([0.0]), t([[1.0]]), LossNorm(), loss_type="grpo", ref_logps=torch.log(t([[0.25]])),
                      beta=0.1)
    close(out.loss, 0.1 * 0.193147)
    close(out.metrics["kl"], 0.193147)
    with pytest.raises(ValueError, match="beta != 0 needs ref_logps"):
        policy_loss(logps, t([0.0]), t([[1.0]]), LossNorm(), beta=0.1)


def test_bias_corrected_kl_by_hand():
    """One token: logp ln .5, ref ln .25, k3 = .5 + ln 2 - 1 = 0.193147. Off-policy with old ln .4 the ratio is
    .5 / .4 = 1.25, so the corrected KL is 1.25 x 0.193147 = 0.241434 (A = 0: the surrogate is 0; beta 1).
    On-policy the ratio is 1 in value (same loss) but not in gradient: d(rho k3)/d logp = k3 + dk3/d logp, with
    dk3/d logp = 1 - exp(ref - logp) = 1 - .5 = .5, so .193147 + .5 = ln 2 instead of .5."""
    ref, mask, zero = torch.log(t([[0.25]])), t([[1.0]]), t([0.0])
    off = policy_loss(torch.log(t([[0.5]])), zero, mask, LossNorm(), loss_type="grpo", ref_logps=ref, beta=1.0,
                      old_logps=torch.log(t([[0.4]])), kl_bias_correction=True)
    close(off.loss, 1.25 * (0.5 + math.log(2) - 1))
    close(off.metrics["kl"], 1.25 * (0.5 + math.log(2) - 1))  # the logged KL is the corrected one, as TRL's
    grads = {}
    for corrected in (False, True):
        logps = torch.log(t([[0.5]])).requires_grad_(True)
        out = policy_loss(logps, zero, mask, LossNorm(), loss_type="grpo", ref_logps=ref, beta=1.0,
                          kl_bias_correction=corrected)
        close(out.loss, 0.5 + math.log(2) - 1)
        (grads[corrected],) = torch.autograd.grad(out.loss, logps)
    close(grads[False], [[0.5]])
    close(grads[True], [[math.log(2)]])
    # sequence level: the row's ratio exp(mean token log-ratio) multiplies every token's KL. Tokens: logp ln .5
    # and ln .5, old ln .4 and ln .5 -> mean log-ratio ln(1.25) / 2 -> ratio sqrt(1.25) = 1.118034.
    two = policy_loss(torch.log(t([[0.5, 0.5]])), zero, t([[1.0, 1.0]]), LossNorm(), loss_type="grpo",
                      ref_logps=torch.log(t([[0.25, 0.25]])), beta=1.0, old_logps=torch.log(t([[0.4, 0.5]])),
                      kl_bias_correction=True, importance_sampling_level="sequence")
    close(two.loss, math.sqrt(1.25) * (0.5 + math.log(2) - 1))


def test_log_importance_ratio_token_and_sequence():
    logps = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    old = t([[-1.1, -2.3, 2.0], [-0.3, -9.0, -9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # token: logps - old = [[0.1, 0.3, -5.0], [-0.2, 8.5, 8.5]]
    close(log_importance_ratio(logps, old, mask, "token"), [[0.1, 0.3, -5.0], [-0.2, 8.5, 8.5]])
    # sequence (GSPO): masked mean -> row 0 (0.1 + 0.3) / 2 = 0.2; row 1 -0.2 / 1 = -0.2; masked tokens ignored
    close(log_importance_ratio(logps, old, mask, "sequence"), [[0.2], [-0.2]])
    # on-policy: the ratio is 1 in value
    close(log_importance_ratio(logps, None, mask, "token"), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="importance_sampling_level must be 'token' or 'sequence'; got 'seq'"):
        log_importance_ratio(logps, old, mask, "seq")


def test_sequence_level_ratio_in_policy_loss():
    # GSPO with loss_type grpo: row ratio exp(0.2) = 1.221403 > 1.2 with A = +1 -> clipped: -1.2 on every token;
    # row 1 ratio exp(-0.2) = 0.818731 inside the band, A = -1 -> 0.818731. Mean over rows: (-1.2 + 0.818731)/2
    logps = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    old = t([[-1.1, -2.3, 2.0], [-0.3, -9.0, -9.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(), loss_type="grpo", old_logps=old,
                      importance_sampling_level="sequence")
    close(out.loss, (-1.2 + math.exp(-0.2)) / 2)
    # the clip flag is per sequence, counted on each of its active tokens: 2 of 3 active tokens
    close(out.metrics["clip_ratio/high_mean"], 2 / 3)


# ---------------------------------------------------------------------------------------------------------------
# Aggregations on a [2, 3] example
# ---------------------------------------------------------------------------------------------------------------

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = t([[1, 1, 0], [1, 0, 0]])
NORM = LossNorm(accumulation_steps=2, window_tokens=10.0, max_completion_length=4)
# Active tokens: 1, 2 | 4 -> masked sum 7, 3 tokens.
AGGREGATED = {
    "grpo": ((1 + 2) / 2 + 4 / 1) / 2 / 2,  # sequence means 1.5, 4 -> mean 2.75 -> / 2 accumulation steps = 1.375
    "bnpo": 7 / 3 / 2,  # local token mean 2.333333 / 2 steps = 1.166667
    "dr_grpo": 7 / (2 * 4) / 2,  # / (B * max_completion_length) = 0.875 / 2 steps = 0.4375
    "dapo": 7 / 10,  # / window_tokens only (already the whole window's count) = 0.7
}


@pytest.mark.parametrize("name", sorted(AGGREGATED))
def test_aggregation_by_hand(name):
    close(AGGREGATIONS[name](LOSS, MASK, NORM), AGGREGATED[name])


def test_aggregations_without_accumulation():
    norm = LossNorm(accumulation_steps=1, window_tokens=3.0, max_completion_length=3)
    close(AGGREGATIONS["grpo"](LOSS, MASK, norm), 2.75)  # (1.5 + 4) / 2
    close(AGGREGATIONS["bnpo"](LOSS, MASK, norm), 7 / 3)
    close(AGGREGATIONS["dr_grpo"](LOSS, MASK, norm), 7 / 6)  # 7 / (2 * 3)
    close(AGGREGATIONS["dapo"](LOSS, MASK, norm), 7 / 3)  # window of 3 tokens = this micro-batch: bnpo's value


def test_empty_rows_do_not_divide_by_zero():
    mask = t([[1, 1, 0], [0, 0, 0]])
    # grpo: row means 1.5 and 0 / clamp(0, 1) = 0 -> 0.75; bnpo: 3 / 2; dapo window 0 -> clamp 1 -> 3
    close(AGGREGATIONS["grpo"](LOSS, mask, LossNorm()), 0.75)
    close(AGGREGATIONS["bnpo"](LOSS, mask, LossNorm()), 1.5)
    close(AGGREGATIONS["dapo"](LOSS, mask, LossNorm(window_tokens=0.0)), 3.0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_aggregation_by_name(loss_type):
    # On-policy with per-token advantages -LOSS: each token's clipped surrogate is -1 * A = LOSS.
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    out = policy_loss(logps, -LOSS, MASK, NORM, loss_type=loss_type)
    close(out.loss, AGGREGATED[loss_type])


def test_loss_types_pair_surrogate_and_aggregation():
    assert LOSS_TYPES == {"grpo": ("clip", "grpo"), "bnpo": ("clip", "bnpo"), "dr_grpo": ("clip", "dr_grpo"),
                          "dapo": ("clip", "dapo"), "cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo")}


def test_unknown_loss_type():
    with pytest.raises(ValueError, match=r"unknown loss_type 'ppo'; choose one of \['bnpo', 'cispo', 'dapo'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), LossNorm(), loss_type="ppo")


# ---------------------------------------------------------------------------------------------------------------
# CISPO and SAPO surrogates
# ---------------------------------------------------------------------------------------------------------------


def test_cispo_per_token_values_and_gradient():
    # loss = -sg(min(rho, cap)) A logp, cap = epsilon_high = 1.2
    #   rho 1.5, A=+2, logp -0.5: -1.2 * 2 * -0.5  = 1.2   (weight capped; counted as high clip)
    #   rho 0.5, A=-1, logp -2.0: -0.5 * -1 * -2.0 = -1.0  (no lower cap in CISPO)
    #   rho 1.0, A=+3, logp -1.0: -1.0 * 3 * -1.0  = 3.0
    logps = t([[-0.5, -2.0, -1.0]]).requires_grad_(True)
    old = logps.detach() - torch.log(t([[1.5, 0.5, 1.0]]))
    loss, clip = cispo_surrogate(logps - old, t([[2.0, -1.0, 3.0]]), logps, 0.2, 1.2)
    close(loss, [[1.2, -1.0, 3.0]])
    assert clip["high"].tolist() == [[True, False, False]] and not clip["low"].any()
    # Every token keeps a gradient, and the weight is a constant: d/d logp = -w A = [-1.2*2, -0.5*-1, -1*3]
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    close(grad, [[-2.4, 0.5, -3.0]])


def test_cispo_through_policy_loss_uses_dapo_aggregation():
    # tokens as above with mask [1, 1, 0]: (1.2 - 1.0) / window_tokens 4 = 0.05
    logps = t([[-0.5, -2.0, -1.0]])
    old = logps - torch.log(t([[1.5, 0.5, 1.0]]))
    out = policy_loss(logps, t([[2.0, -1.0, 3.0]]), t([[1, 1, 0]]), LossNorm(window_tokens=4.0), loss_type="cispo",
                      old_logps=old, epsilon_high=1.2)
    close(out.loss, 0.05)
    close(out.metrics["clip_ratio/high_mean"], 0.5)  # 1 of 2 active tokens


def test_sapo_per_token_values():
    # loss = -(4 / tau) sigmoid(tau (rho - 1)) A, tau = 1.0 for A > 0, 1.05 for A < 0
    #   rho 1.5, A=+1: -4 * sigmoid(0.5) = -4 * 0.622459 = -2.489837
    #   rho 0.5, A=-1: (4 / 1.05) * sigmoid(-0.525) = 3.809524 * 0.371684 = 1.415939
    #   rho 1.0, A=+2: -4 * 0.5 * 2 = -4.0
    loss, clip, _ = surrogate_at(sapo_surrogate, [1.5, 0.5, 1.0], [1, -1, 2], epsilon_low=0.2, epsilon_high=0.2)
    close(loss, [-2.489837, 1.415939, -4.0])
    assert not clip["low"].any() and not clip["high"].any()
    loss, _, _ = surrogate_at(sapo_surrogate, [1.5], [1], epsilon_low=0.2, epsilon_high=0.2, temperature_pos=2.0)
    close(loss, [-2 * 1 / (1 + math.exp(-1.0))])  # -(4/2) sigmoid(2 * 0.5) = -2 * 0.731059 = -1.462117


@pytest.mark.parametrize("advantage", [1.5, -0.7])
def test_sapo_gradient_at_ratio_one_matches_unclipped(advantage):
    # d/d log rho [-(4/tau) sigmoid(tau (rho - 1)) A] at rho = 1 = -(4/tau) * (1/4) * tau * 1 * A = -A
    _, _, grad = surrogate_at(sapo_surrogate, [1.0], [advantage], epsilon_low=0.2, epsilon_high=0.2)
    close(grad, [-advantage])


# ---------------------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_on_policy_ratio_one_gradient_is_minus_advantage_times_grad_log_pi(loss_type):
    # pi = softmax(theta) over 5 tokens; 2 sequences of 3 sampled tokens
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 3, 5, dtype=F64, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=generator)
    mask, advantages = t([[1, 1, 1], [1, 1, 0]]), t([0.8, -1.3])
    norm = LossNorm(accumulation_steps=1, window_tokens=5.0, max_completion_length=3)

    def logps_of(theta):
        return torch.log_softmax(theta, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    out = policy_loss(logps_of(theta), advantages, mask, norm, loss_type=loss_type, epsilon_high=5.0)
    (grad,) = torch.autograd.grad(out.loss, theta)
    # REINFORCE form: the same aggregation of the per-token -A log pi
    reinforce = AGGREGATIONS[LOSS_TYPES[loss_type][1]](-advantages[:, None] * logps_of(theta), mask, norm)
    (expected,) = torch.autograd.grad(reinforce, theta)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    # In value, ratio 1 gives -A per token for the clipped surrogate (SAPO's value there is -(2/tau) A instead).
    if LOSS_TYPES[loss_type][0] == "clip":
        per_token = -advantages[:, None].expand(2, 3)
        close(out.loss, AGGREGATIONS[LOSS_TYPES[loss_type][1]](per_token, mask, norm))


def gradcheck_inputs():
    generator = torch.Generator().manual_seed(1)
    logps = -torch.rand(2, 4, dtype=F64, generator=generator) - 0.1
    # ratios exp(logps - old) = exp(shift): 1.65, 1.105, 0.951, 0.741, ... all at least 0.04 from a clip edge
    shift = t([[0.5, 0.1, -0.05, -0.3], [-0.5, 0.3, 0.15, -0.12]])
    old = logps - shift
    ref = logps + t([[0.2, -0.1, 0.3, 0.0], [-0.4, 0.1, 0.05, -0.2]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    return logps.requires_grad_(True), old, ref, mask, t([1.3, -0.6])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_gradcheck(loss_type, level):
    logps, old, ref, mask, advantages = gradcheck_inputs()
    norm = LossNorm(accumulation_steps=2, window_tokens=5.0, max_completion_length=4)
    # CISPO stops the gradient through its weight on purpose; with every weight capped (cap 0.5 < every ratio:
    # smallest is exp(-0.5) = 0.607) the weight is a constant and the analytic gradient is the true one.
    eps_high = 0.5 if loss_type == "cispo" else 0.28

    def loss(logps):
        return policy_loss(logps, advantages, mask, norm, loss_type=loss_type, old_logps=old, ref_logps=ref,
                           beta=0.04, epsilon_low=0.2, epsilon_high=eps_high, importance_sampling_level=level).loss

    assert torch.autograd.gradcheck(loss, (logps,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("split", [[4], [1, 3], [2, 2], [3, 1], [1, 1, 1, 1]], ids=str)
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_dapo_invariant_to_micro_batch_split(split, loss_type):
    generator = torch.Generator().manual_seed(2)
    logps = -torch.rand(4, 5, dtype=F64, generator=generator) - 0.1
    old = logps - 0.3 * torch.randn(4, 5, dtype=F64, generator=generator)
    advantages = torch.randn(4, dtype=F64, generator=generator)
    lengths = [5, 1, 3, 4]  # ragged: a token mean is not a mean of micro-batch means
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).to(F64)
    whole = LossNorm(accumulation_steps=1, window_tokens=float(sum(lengths)), max_completion_length=5)
    kwargs = {"loss_type": loss_type, "old_logps": old, "epsilon_high": 1.28}

    full_logps = logps.clone().requires_grad_(True)
    full = policy_loss(full_logps, advantages, mask, whole, **kwargs).loss
    full.backward()

    split_logps = logps.clone().requires_grad_(True)
    norm = whole._replace(accumulation_steps=len(split))
    total, start = torch.zeros((), dtype=F64), 0
    for size in split:
        rows = slice(start, start + size)
        part = policy_loss(split_logps[rows], advantages[rows], mask[rows], norm, **{**kwargs, "old_logps": old[rows]})
        part.loss.backward()
        total, start = total + part.loss.detach(), start + size
    torch.testing.assert_close(total, full.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(split_logps.grad, full_logps.grad, atol=1e-12, rtol=0)


def test_bnpo_is_not_split_invariant():
    """Contrast for the test above: a local token mean depends on the split when lengths differ."""
    loss, mask = t([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 0, 0]])
    # whole: (1 + 1 + 1 + 4) / 4 tokens = 1.75; split [1, 1] with 2 steps: (3/3)/2 + (4/1)/2 = 2.5
    close(AGGREGATIONS["bnpo"](loss, mask, LossNorm()), 1.75)
    norm = LossNorm(accumulation_steps=2)
    close(AGGREGATIONS["bnpo"](loss[:1], mask[:1], norm) + AGGREGATIONS["bnpo"](loss[1:], mask[1:], norm), 2.5)


def test_policy_loss_passes_the_sapo_temperatures():
    # One token, rho = e^0.5, A = 1, tau_pos = 2: per-token loss -(4/2) * sigmoid(2 * (e^0.5 - 1)) * 1, and the
    # `grpo` aggregation of a single token is that token's value.
    logps, old = torch.tensor([[0.0]]), torch.tensor([[-0.5]])
    out = policy_loss(logps, torch.tensor([1.0]), torch.ones(1, 1), LossNorm(), loss_type="sapo", old_logps=old,
                      sapo_temperature_pos=2.0)
    expected = -(4 / 2) * torch.sigmoid(torch.tensor(2 * (math.exp(0.5) - 1)))
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Multi-turn: a hole in the mask (a tool's tokens between two sampled turns)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss_type", "value"), [
    # One row, logps [-1, -2, -3], mask [1, 0, 1] (token 1 a tool's), A = 2, on-policy (rho = 1 in value).
    # clip: per token -A * rho = -2; grpo/bnpo: token mean over the 2 sampled tokens = -2; dapo: sum -4 over the
    # window's 2 tokens = -2; dr_grpo: sum -4 over B * max_completion_length = 1 * 4 -> -1.
    ("grpo", -2.0), ("bnpo", -2.0), ("dapo", -2.0), ("dr_grpo", -1.0),
    # cispo: -sg(min(rho, 5)) * A * logp = -2 * logp -> [2, ., 6], summed over sampled tokens 8 / 2 tokens = 4.
    ("cispo", 4.0),
    # sapo: -(4 / tau) sigmoid(0) A = -(4 / 1) * 0.5 * 2 = -4 per token, sequence mean -4.
    ("sapo", -4.0),
])
def test_a_tool_token_adds_nothing_to_the_loss_or_its_gradient(loss_type, value):
    logps = t([[-1.0, -2.0, -3.0]]).requires_grad_(True)
    norm = LossNorm(accumulation_steps=1, window_tokens=2.0, max_completion_length=4)
    out = policy_loss(logps, t([2.0]), t([[1, 0, 1]]), norm, loss_type=loss_type, epsilon_high=5.0)
    (grad,) = torch.autograd.grad(out.loss, logps)
    close(out.loss, value)
    # d loss / d logp_t on a sampled token, by loss type: grpo/bnpo/dapo -A/2 = -1 (mean over 2 tokens), dr_grpo
    # -A/4 = -0.5; cispo -2 * 1/2 = -1; sapo -(4/tau) * tau * sigmoid'(0) * A / 2 = -4 * 0.25 * 2 / 2 = -1. The tool's
    # token: exactly 0, whatever its log-prob.
    sampled = -0.5 if loss_type == "dr_grpo" else -1.0
    close(grad, [[sampled, 0.0, sampled]])
    moved = t([[-1.0, -50.0, -3.0]])  # the tool token's log-prob changes nothing
    close(policy_loss(moved, t([2.0]), t([[1, 0, 1]]), norm, loss_type=loss_type, epsilon_high=5.0).loss, value)
