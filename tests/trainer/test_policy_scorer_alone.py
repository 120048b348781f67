"""`PolicyScorer` (`trainer.scoring`) built alone from its typed settings, on a tiny model and a hand-made round: each
of its decisions checked against a plain forward's log-probs (`parts_alone.plain_logps`) or against values the round
itself carries, which a forward could not produce."""

import dataclasses

import pytest
import torch

from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.trainer.schedule import Schedule
from grpo_trainer.trainer.scoring import PolicyScorer, ScoringSettings
from tests.trainer.parts_alone import (
    ForwardCount,
    hand_round,
    masked,
    plain_entropy,
    plain_logps,
    tiny_model,
)

ON_POLICY = Schedule()  # one micro-step per round, one per optimizer step
OFF_POLICY = Schedule(num_iterations=2)  # each micro-batch trained twice: the second pass is after an update


def scorer(schedule: Schedule = ON_POLICY, ref_model=None, padding_free: bool = False, **settings) -> PolicyScorer:
    return PolicyScorer(ScoringSettings(ForwardSettings(padding_free=padding_free), **settings), schedule, ref_model)


def sampler_values(round_, shift: float) -> torch.Tensor:
    """`[B, T]` log-probs a forward cannot give: the plain forward's moved by `shift` nats, 0 on padding."""
    return (plain_logps(tiny_model(), round_) + shift) * round_.completion_mask


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("rows_per_forward", [1, 3, 8])
def test_a_no_grad_forward_gives_the_plain_forwards_log_probs_in_either_layout_and_any_row_count(padding_free,
                                                                                                rows_per_forward):
    model, round_ = tiny_model(), hand_round()
    part = scorer(padding_free=padding_free, rows_per_forward=rows_per_forward)
    with torch.no_grad():
        logps = part.no_grad_logps(model, round_.trimmed())
    torch.testing.assert_close(masked(logps, round_), plain_logps(model, round_))


def test_on_policy_prepare_adds_no_old_or_reference_log_probs_and_runs_no_forward():
    """Decision 1: on-policy the loss's own log-probs (detached) are the old ones; beta == 0: no reference."""
    model, round_ = tiny_model(), hand_round()
    with ForwardCount(model) as count:
        prepared = scorer().prepare(round_, "train", model)
    assert count.calls == 0 and prepared.old_logps is None and prepared.ref_logps is None


def test_off_policy_old_log_probs_come_from_one_forward_at_the_rounds_weights():
    """Decision 1: a round trained after an update gets old log-probs by a no-grad forward, as the plain forward
    computes them; the sampler's stand-ins are dropped (they are not the current weights' values)."""
    model = tiny_model()
    logps = sampler_values(hand_round(), 0.0)
    round_ = hand_round(sampler=SamplerRecord(kind="generate", logps=logps, entropy=torch.zeros_like(logps),
                                              exact=False))
    prepared = scorer(OFF_POLICY).prepare(round_, "train", model)
    torch.testing.assert_close(masked(prepared.old_logps, round_), plain_logps(model, round_))
    assert prepared.sampler.entropy is None and not prepared.sampler.exact


def test_off_policy_an_exact_sampler_s_log_probs_are_the_old_ones_without_a_forward():
    """Decision 1: the fast decoder's log-probs were computed as the loss computes them at the round's weights, so
    they become the old log-probs as they are (the plain forward's + 0.25 here: no forward could give them), and
    the record keeps no second copy."""
    model = tiny_model()
    given = sampler_values(hand_round(), 0.25)
    round_ = hand_round(sampler=SamplerRecord(kind="decoder", logps=given, exact=True))
    with ForwardCount(model) as count:
        prepared = scorer(OFF_POLICY).prepare(round_, "train", model)
    assert count.calls == 0
    assert torch.equal(prepared.old_logps, given) and prepared.sampler.logps is None


def test_old_log_probs_a_round_already_carries_are_kept():
    """Decision 1: old log-probs set before preparation (`trainer.off_policy`: an engine's correction, a round
    sampled ahead) are the ones the loss uses; no forward replaces them."""
    model = tiny_model()
    given = sampler_values(hand_round(), -0.5)
    round_ = dataclasses.replace(hand_round(), old_logps=given)
    with ForwardCount(model) as count:
        prepared = scorer(OFF_POLICY).prepare(round_, "train", model)
    assert count.calls == 0 and torch.equal(prepared.old_logps, given)


def test_evaluation_is_on_policy_whatever_the_schedule():
    model, round_ = tiny_model(), hand_round()
    assert scorer(OFF_POLICY).prepare(round_, "eval", model).old_logps is None


def test_beta_adds_the_reference_models_log_probs():
    """Decision 1: beta != 0 adds the reference model's log-probs (another model here: they differ from the
    policy's), on- and off-policy."""
    model, reference, round_ = tiny_model(), tiny_model(seed=1), hand_round()
    for schedule in (ON_POLICY, OFF_POLICY):
        prepared = scorer(schedule, ref_model=reference, beta=0.04).prepare(round_, "train", model)
        torch.testing.assert_close(masked(prepared.ref_logps, round_), plain_logps(reference, round_))
    assert not torch.allclose(plain_logps(reference, round_), plain_logps(model, round_))


def test_skip_gives_old_log_probs_only_to_rows_with_a_nonzero_advantage():
    """Decision 3: with `skip_zero_advantages`, off-policy, rows 1 and 3 (advantage 0) get old log-probs of 0 and
    rows 0 and 2 the forward's."""
    model = tiny_model()
    round_ = hand_round(advantages=(1.0, 0.0, -1.0, 0.0))
    prepared = scorer(OFF_POLICY, skip_zero_advantages=True).prepare(round_, "train", model)
    expected = plain_logps(model, round_) * torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    torch.testing.assert_close(masked(prepared.old_logps, round_), expected)


def test_policy_log_probs_of_skipped_rows_are_their_old_ones_so_their_ratio_is_exactly_one():
    """Decision 3: only rows 0 and 2 run forward; rows 1 and 3 get their old log-probs (ratio exactly 1), entropy 0
    and no measured tokens."""
    model = tiny_model()
    round_ = hand_round(advantages=(1.0, 0.0, -1.0, 0.0))
    old = sampler_values(round_, -0.5)
    part = dataclasses.replace(round_, old_logps=old).trimmed()
    out = scorer(OFF_POLICY).policy_logps(model, part, skip_zero_advantages=True)
    ran = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    forward = plain_logps(model, round_)
    torch.testing.assert_close(masked(out.logps.detach(), round_), forward * ran + old * (1 - ran))
    torch.testing.assert_close(masked(out.entropy.detach(), round_), plain_entropy(model, round_) * ran)
    assert torch.equal(out.measured, part.loss_mask * ran.int())
    everything = scorer(OFF_POLICY).policy_logps(model, part, skip_zero_advantages=False)
    torch.testing.assert_close(masked(everything.logps.detach(), round_), forward)
    assert torch.equal(everything.measured, part.loss_mask)


def test_on_policy_the_exact_samplers_values_stand_in_for_the_policy_forwards():
    """Decision 2: on-policy an exact sampler's log-probs are the policy forward's values (the plain forward's +
    0.25 here, which the model would not give), while the same call for another model, not the sampling policy,
    computes its own."""
    model = tiny_model()
    given = sampler_values(hand_round(), 0.25)
    round_ = hand_round(sampler=SamplerRecord(kind="decoder", logps=given, entropy=torch.zeros_like(given),
                                              exact=True))
    part = scorer()
    stood_in = part.policy_logps(model, round_.trimmed(), skip_zero_advantages=False)
    torch.testing.assert_close(masked(stood_in.logps.detach(), round_), given)
    computed = part.logps(model, round_.trimmed(), policy=False)
    torch.testing.assert_close(masked(computed.logps.detach(), round_), plain_logps(model, round_))
