"""Policy-loss math against hand-derived numbers, autograd and gradcheck.

Notation: rho = pi_theta / pi_old (the importance ratio), A the advantage, eps the clip range.
"""

import math

import pytest
import torch

from grpo_trainer.algorithms.losses import (
    AGGREGATIONS,
    LOSS_TYPES,
    SEQUENCE_METRICS,
    LossNorm,
    SurrogateParams,
    kl_k3,
    log_importance_ratio,
    nanmax,
    nanmin,
    policy_loss,
)
from tests.algorithms.numeric import F64, close, t

# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


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
    assert "kl" not in out.metrics and "policy_loss" not in out.metrics  # policy_loss only with the entropy bonus
    # per completion: low fractions 0/3 and 1/2, high 1/3 and 0/2; the trainer takes the min / max over all
    # completions of every process
    close(out.per_sequence["clip_ratio/low_min"], [0.0, 0.5])
    close(out.per_sequence["clip_ratio/high_max"], [1 / 3, 0.0])
    assert SEQUENCE_METRICS["clip_ratio/low_min"][1] is nanmin and SEQUENCE_METRICS["clip_ratio/high_max"][1] is nanmax
    # loss (dapo, window 5): tokens -1.2, -1.0, -0.5 | 0.8, 1.5 -> sum -0.4 / 5 = -0.08
    close(out.loss, -0.08)


def test_an_empty_completion_is_left_out_of_the_extremes():
    # row 1 has no token: its fraction is 0/0 = NaN, which nanmin/nanmax skip (TRL's nanmin/nanmax)
    old = torch.zeros(2, 2, dtype=F64)
    out = policy_loss(old + torch.log(t([[0.5, 1.0], [1.0, 1.0]])), t([-1.0, 1.0]), t([[1, 1], [0, 0]]), LossNorm(),
                      old_logps=old)
    low = out.per_sequence["clip_ratio/low_min"]
    assert low[0].item() == 0.5 and math.isnan(low[1].item())
    close(nanmin(low), 0.5)
    close(nanmax(t([math.nan, -2.0, 3.0])), 3.0)
    assert math.isnan(nanmin(t([math.nan, math.nan])).item()) and math.isnan(nanmax(t([math.nan])).item())


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
    # the clip flag is per sequence [B, 1], so the metric is a mean over sequences (TRL's): 1 of 2 sequences
    close(out.metrics["clip_ratio/high_mean"], 1 / 2)
    close(out.per_sequence["clip_ratio/high_max"], [1.0, 0.0])


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
    "luspo": ((1 + 2) + 4) / 2 / 2,  # sequence sums 3, 4 -> mean 3.5 -> / 2 accumulation steps = 1.75
}


def test_every_aggregation_and_loss_type_has_a_hand_derived_value():
    assert set(AGGREGATED) == set(AGGREGATIONS)
    assert {aggregation for _, aggregation in LOSS_TYPES.values()} <= set(AGGREGATIONS)


@pytest.mark.parametrize("name", sorted(AGGREGATED))
def test_aggregation_by_hand(name):
    close(AGGREGATIONS[name](LOSS, MASK, NORM), AGGREGATED[name])


def test_aggregations_without_accumulation():
    norm = LossNorm(accumulation_steps=1, window_tokens=3.0, max_completion_length=3)
    close(AGGREGATIONS["grpo"](LOSS, MASK, norm), 2.75)  # (1.5 + 4) / 2
    close(AGGREGATIONS["bnpo"](LOSS, MASK, norm), 7 / 3)
    close(AGGREGATIONS["dr_grpo"](LOSS, MASK, norm), 7 / 6)  # 7 / (2 * 3)
    close(AGGREGATIONS["dapo"](LOSS, MASK, norm), 7 / 3)  # window of 3 tokens = this micro-batch: bnpo's value
    close(AGGREGATIONS["luspo"](LOSS, MASK, norm), 3.5)  # (3 + 4) / 2


def test_empty_rows_do_not_divide_by_zero():
    mask = t([[1, 1, 0], [0, 0, 0]])
    # grpo: row means 1.5 and 0 / clamp(0, 1) = 0 -> 0.75; bnpo: 3 / 2; dapo window 0 -> clamp 1 -> 3
    close(AGGREGATIONS["grpo"](LOSS, mask, LossNorm()), 0.75)
    close(AGGREGATIONS["bnpo"](LOSS, mask, LossNorm()), 1.5)
    close(AGGREGATIONS["dapo"](LOSS, mask, LossNorm(window_tokens=0.0)), 3.0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_policy_loss_aggregation_by_name(loss_type):
    # On-policy with per-token advantages -LOSS: each token's clipped surrogate is -1 * A = LOSS.
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    out = policy_loss(logps, -LOSS, MASK, NORM, loss_type=loss_type)
    close(out.loss, AGGREGATED[loss_type])


def test_loss_types_pair_surrogate_and_aggregation():
    assert LOSS_TYPES == {"grpo": ("clip", "grpo"), "bnpo": ("clip", "bnpo"), "dr_grpo": ("clip", "dr_grpo"),
                          "dapo": ("clip", "dapo"), "luspo": ("clip", "luspo"), "cispo": ("cispo", "dapo"),
                          "sapo": ("sapo", "grpo"), "vespo": ("vespo", "dapo")}
    # TRL 1.16's loss types, all of them
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}


def test_unknown_loss_type():
    with pytest.raises(ValueError, match=r"unknown loss_type 'ppo'; choose one of \['bnpo', 'cispo', 'dapo'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), LossNorm(), loss_type="ppo")


# ---------------------------------------------------------------------------------------------------------------
# CISPO, VESPO and LUSPO through policy_loss
# ---------------------------------------------------------------------------------------------------------------


def test_cispo_through_policy_loss_uses_dapo_aggregation():
    # tokens: rho 1.5, 0.5, 1.0, A 2, -1, 3, logp -0.5, -2, -1; loss -min(rho, 1.2) A logp = 1.2, -1.0, 3.0;
    # mask [1, 1, 0]: (1.2 - 1.0) / window_tokens 4 = 0.05
    logps = t([[-0.5, -2.0, -1.0]])
    old = logps - torch.log(t([[1.5, 0.5, 1.0]]))
    out = policy_loss(logps, t([[2.0, -1.0, 3.0]]), t([[1, 1, 0]]), LossNorm(window_tokens=4.0), loss_type="cispo",
                      old_logps=old, params=SurrogateParams(epsilon_high=1.2))
    close(out.loss, 0.05)
    # TRL logs cispo_clip_ratio (1 of 2 active tokens capped with A > 0), and no clip_ratio/* for cispo
    assert set(out.metrics) == {"cispo_clip_ratio"} and out.per_sequence == {}
    close(out.metrics["cispo_clip_ratio"], 0.5)


def test_vespo_through_policy_loss():
    # Off-policy rows (see test_surrogates.test_gamma_weights_by_hand): row 0 log w = 0.1 + 0.2 = 0.3, A = +1,
    # phi 0.637898; row 1 log w = -0.5, A = -1, phi 0.490141. logps -1, -2 | -0.5 (masked -3).
    # tokens: -0.637898 * 1 * [-1, -2] = 0.637898, 1.275797; -0.490141 * -1 * -0.5 = -0.245071
    # dapo aggregation over window_tokens 3: (0.637898 + 1.275797 - 0.245071) / 3 = 0.556208
    logps, mask = t([[-1.0, -2.0], [-0.5, -3.0]]), t([[1, 1], [1, 0]])
    old = logps - t([[0.1, 0.2], [-0.5, 7.0]])
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(window_tokens=3.0), loss_type="vespo", old_logps=old)
    close(out.loss, (0.637898 + 1.275797 - 0.245071) / 3)
    close(out.metrics["vespo/phi_seq_mean"], (0.637898 + 0.490141) / 2)  # a mean over sequences
    assert set(out.metrics) == {"vespo/phi_seq_mean"}
    # the sequence level does not change VESPO's weight (it reads the token ratios)
    seq = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(window_tokens=3.0), loss_type="vespo", old_logps=old,
                      importance_sampling_level="sequence")
    close(seq.loss, out.loss)


def test_vespo_is_reinforce_on_policy():
    # On-policy w = 1 and phi(1) = e^lam * 1 * e^-lam = 1: loss = -A log pi, aggregated like dapo.
    # tokens -1 * [-1, -2], -(-1) * -0.5 -> 1 + 2 - 0.5 = 2.5, / 3 window tokens
    logps, mask = t([[-1.0, -2.0], [-0.5, -3.0]]), t([[1, 1], [1, 0]])
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(window_tokens=3.0), loss_type="vespo")
    close(out.loss, 2.5 / 3)
    close(out.metrics["vespo/phi_seq_mean"], 1.0)


def test_luspo_weighs_each_sequence_by_its_length():
    # GSPO-style sequence ratios with the luspo sum: rows of 3 and 1 active tokens, A = +1, -1, on-policy
    # (ratio 1): per-token losses -1 and +1. Sequence sums -3 and +1 -> mean -1, / 2 accumulation steps = -0.5.
    # (`grpo` would give token means -1 and +1 -> mean 0.)
    logps, mask = torch.zeros(2, 3, dtype=F64), t([[1, 1, 1], [1, 0, 0]])
    norm = LossNorm(accumulation_steps=2)
    out = policy_loss(logps, t([1.0, -1.0]), mask, norm, loss_type="luspo", importance_sampling_level="sequence")
    close(out.loss, -0.5)
    close(policy_loss(logps, t([1.0, -1.0]), mask, norm, loss_type="grpo").loss, 0.0)


def test_policy_loss_passes_the_surrogate_params():
    # One token, rho = e^0.5, A = 1, tau_pos = 2: per-token loss -(4/2) * sigmoid(2 * (e^0.5 - 1)) * 1, and the
    # `grpo` aggregation of a single token is that token's value.
    logps, old = torch.tensor([[0.0]]), torch.tensor([[-0.5]])
    out = policy_loss(logps, torch.tensor([1.0]), torch.ones(1, 1), LossNorm(), loss_type="sapo", old_logps=old,
                      params=SurrogateParams(sapo_temperature_pos=2.0))
    expected = -(4 / 2) * torch.sigmoid(torch.tensor(2 * (math.exp(0.5) - 1)))
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    # VESPO's (k, lambda): on a w = e^0.3 row with A = +1, k = 1, lambda = 1: phi = exp(1 + 0.3 - e^0.3) =
    # exp(-0.049859) = 0.951364; one token logp -1 -> loss 0.951364 (window 1)
    out = policy_loss(t([[-1.0]]), t([1.0]), t([[1.0]]), LossNorm(), loss_type="vespo", old_logps=t([[-1.3]]),
                      params=SurrogateParams(vespo_k_pos=1.0, vespo_lambda_pos=1.0))
    close(out.loss, math.exp(1.3 - math.exp(0.3)))


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

    out = policy_loss(logps_of(theta), advantages, mask, norm, loss_type=loss_type,
                      params=SurrogateParams(epsilon_high=5.0))
    (grad,) = torch.autograd.grad(out.loss, theta)
    # REINFORCE form: the same aggregation of the per-token -A log pi
    reinforce = AGGREGATIONS[LOSS_TYPES[loss_type][1]](-advantages[:, None] * logps_of(theta), mask, norm)
    (expected,) = torch.autograd.grad(reinforce, theta)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    # In value, ratio 1 gives -A per token for the clipped surrogate (SAPO's value there is -(2/tau) A instead;
    # CISPO's and VESPO's -A log pi).
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
    # VESPO stops the gradient through phi(w) on purpose; on-policy w is 1 whatever logps, so phi is the constant 1.
    old = None if loss_type == "vespo" else old

    def loss(logps):
        return policy_loss(logps, advantages, mask, norm, loss_type=loss_type, old_logps=old, ref_logps=ref,
                           beta=0.04, params=SurrogateParams(epsilon_low=0.2, epsilon_high=eps_high),
                           importance_sampling_level=level).loss

    assert torch.autograd.gradcheck(loss, (logps,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("split", [[4], [1, 3], [2, 2], [3, 1], [1, 1, 1, 1]], ids=str)
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_dapo_invariant_to_micro_batch_split(split, loss_type):
    generator = torch.Generator().manual_seed(2)
    logps = -torch.rand(4, 5, dtype=F64, generator=generator) - 0.1
    old = logps - 0.3 * torch.randn(4, 5, dtype=F64, generator=generator)
    advantages = torch.randn(4, dtype=F64, generator=generator)
    lengths = [5, 1, 3, 4]  # ragged: a token mean is not a mean of micro-batch means
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).to(F64)
    whole = LossNorm(accumulation_steps=1, window_tokens=float(sum(lengths)), max_completion_length=5)
    kwargs = {"loss_type": loss_type, "old_logps": old, "params": SurrogateParams(epsilon_high=1.28)}

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


# ---------------------------------------------------------------------------------------------------------------
# The off-policy sequence mask in the loss
# ---------------------------------------------------------------------------------------------------------------


def test_off_policy_mask_drops_the_surrogate_not_the_kl():
    # One token per row, A = -1 both, threshold 0.5. Drift (sampling - current): row 0 0 - (-1) = 1 > 0.5 ->
    # dropped; row 1 -1.1 - (-1) = -0.1 -> kept.
    #   row 0: rho e^-1 = 0.367879 -> -min(-0.367879, -0.8) = 0.8, dropped -> 0
    #   row 1: rho e^0.1 = 1.105171 inside the band -> 1.105171
    # grpo: (0 + 1.105171) / 2 = 0.552585
    logps, old, mask, advantages = t([[-1.0], [-1.0]]), t([[0.0], [-1.1]]), t([[1.0], [1.0]]), t([-1.0, -1.0])
    kwargs = {"loss_type": "grpo", "old_logps": old, "off_policy_threshold": 0.5}
    close(policy_loss(logps, advantages, mask, LossNorm(), **kwargs).loss, math.exp(0.1) / 2)
    # The rollout's sampling log-probs, when given, are the reference instead of old_logps: drift 0, both kept
    close(policy_loss(logps, advantages, mask, LossNorm(), sampling_logps=logps.clone(), **kwargs).loss,
          (0.8 + math.exp(0.1)) / 2)
    # beta * KL stays on the dropped row: ref ln-prob -2 on row 0: k3 = e^-1 + 1 - 1 = 0.367879 (row 1: 0)
    with_kl = policy_loss(logps, advantages, mask, LossNorm(), ref_logps=t([[-2.0], [-1.0]]), beta=1.0, **kwargs)
    close(with_kl.loss, (math.exp(-1) + math.exp(0.1)) / 2)
    # on-policy the drift is 0: nothing is dropped (A = -1 on-policy: -(-1) per token -> 1)
    close(policy_loss(logps, advantages, mask, LossNorm(), loss_type="grpo", off_policy_threshold=0.5).loss, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Multi-turn: a hole in the mask (a tool's tokens between two sampled turns)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loss_type", "value", "sampled"), [
    # One row, logps [-1, -2, -3], mask [1, 0, 1] (token 1 a tool's), A = 2, on-policy (rho = 1 in value).
    # clip: per token -A * rho = -2, gradient -A = -2 per sampled token before aggregation.
    #   grpo/bnpo: token mean over the 2 sampled tokens = -2, gradient -2/2 = -1; dapo: sum -4 over the window's
    #   2 tokens = -2, gradient -1; dr_grpo: sum -4 over B * max_completion_length = 4 -> -1, gradient -2/4 = -0.5;
    #   luspo: the sequence's sum -4, gradient -2.
    ("grpo", -2.0, -1.0), ("bnpo", -2.0, -1.0), ("dapo", -2.0, -1.0), ("dr_grpo", -1.0, -0.5), ("luspo", -4.0, -2.0),
    # cispo: -sg(min(rho, 5)) * A * logp = -2 * logp -> [2, ., 6]; sum 8 over 2 tokens = 4, gradient -2/2 = -1.
    ("cispo", 4.0, -1.0),
    # vespo: log w = sum of the token log-ratios = 0, phi(1) = e^(lambda + 0 - lambda) = 1: -A * logp as cispo.
    ("vespo", 4.0, -1.0),
    # sapo: -(4 / tau) sigmoid(0) A = -(4 / 1) * 0.5 * 2 = -4 per token, sequence mean -4; gradient
    #   -(4 / tau) * tau * sigmoid'(0) * A / 2 = -4 * 0.25 * 2 / 2 = -1.
    ("sapo", -4.0, -1.0),
])
def test_a_tool_token_adds_nothing_to_the_loss_or_its_gradient(loss_type, value, sampled):
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dapo", "dr_grpo", "luspo", "cispo", "vespo", "sapo"}  # all here
    logps = t([[-1.0, -2.0, -3.0]]).requires_grad_(True)
    norm = LossNorm(accumulation_steps=1, window_tokens=2.0, max_completion_length=4)
    params = SurrogateParams(epsilon_high=5.0)
    out = policy_loss(logps, t([2.0]), t([[1, 0, 1]]), norm, loss_type=loss_type, params=params)
    (grad,) = torch.autograd.grad(out.loss, logps)
    close(out.loss, value)
    close(grad, [[sampled, 0.0, sampled]])  # the tool's token: exactly 0
    moved = t([[-1.0, -50.0, -3.0]])  # whatever its log-prob
    close(policy_loss(moved, t([2.0]), t([[1, 0, 1]]), norm, loss_type=loss_type, params=params).loss, value)


# ---------------------------------------------------------------------------------------------------------------
# The inference engine's importance weight in the loss
# ---------------------------------------------------------------------------------------------------------------


def test_engine_ratio_weights_the_surrogate_not_the_kl():
    # On-policy (rho 1), grpo, A = [+1, -1], one row of two tokens each, engine weights [[0.5, 1.5], [2.0, 0.0]]:
    #   row 0: -1 * [0.5, 1.5] -> mean -1.0; row 1: +1 * [2.0, 0.0] -> mean 1.0; grpo mean over rows = 0.0
    # with beta 1 and ref = logps - 1 on every token: k3 = e^-1 + 1 - 1 = 0.367879 per token, unweighted
    #   -> 0.0 + 0.367879
    logps, mask = t([[-1.0, -2.0], [-0.5, -0.7]]), t([[1, 1], [1, 1]])
    weights = t([[0.5, 1.5], [2.0, 0.0]])
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(), loss_type="grpo", engine_ratio=weights)
    close(out.loss, 0.0)
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(), loss_type="grpo", engine_ratio=weights,
                      ref_logps=logps - 1.0, beta=1.0)
    close(out.loss, math.exp(-1))
    # its gradient: d/d logp of -A rho w = -A w per token (rho = 1): [[-0.5, -1.5], [2, 0]] / 2 tokens / 2 rows
    logps = logps.clone().requires_grad_(True)
    out = policy_loss(logps, t([1.0, -1.0]), mask, LossNorm(), loss_type="grpo", engine_ratio=weights)
    (grad,) = torch.autograd.grad(out.loss, logps)
    close(grad, [[-0.125, -0.375], [0.5, 0.0]])
