"""`OffPolicy` (`trainer.off_policy`) built alone from its typed settings, scoring with a `PolicyScorer` on a tiny
model: decision 1's five kinds of round, each's old log-probs and importance weights, then what the scorer's
preparation makes of them (`PolicyScorer.prepare`, which computes the old log-probs of the rounds `OffPolicy` leaves
without).

The sampler's log-probs are set by hand relative to the plain forward's (`parts_alone.plain_logps`, "pi_old"): an
engine that gave every token half the trainer's probability (log pi_engine = log pi_old - log 2) has rho = 2 per
token, and a behaviour policy 1.25 times less likely has rho = 1.25, so every weight below is worked out by hand.
"""

import math

import pytest
import torch

from grpo_trainer.algorithms.engine_correction import EngineCorrection
from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.trainer.off_policy import OffPolicy, OffPolicySettings
from grpo_trainer.trainer.schedule import Schedule
from grpo_trainer.trainer.scoring import PolicyScorer, ScoringSettings
from tests.trainer.parts_alone import LENGTHS, ForwardCount, hand_round, masked, plain_logps, tiny_model

ON_POLICY = Schedule()
OFF_POLICY = Schedule(num_iterations=2)  # the second pass over each micro-batch runs after an optimizer step
AHEAD = Schedule(rounds_ahead=1)  # `async_rollouts=1`: every training round was sampled before the last update
TRUNCATE = EngineCorrection("token_truncate", clip_min=None, clip_max=1.5)


def parts(settings: OffPolicySettings, schedule: Schedule) -> tuple[OffPolicy, PolicyScorer, MetricsWindow]:
    scorer = PolicyScorer(ScoringSettings(ForwardSettings(padding_free=False)), schedule, None)
    metrics = MetricsWindow()
    return OffPolicy(settings, schedule, scorer.sampling_scores, None, metrics), scorer, metrics


def record(kind: str, shift: float, exact: bool) -> SamplerRecord:
    """A sampler record whose log-probs are the plain forward's + `shift` nats on every completion token."""
    round_ = hand_round()
    logps = (plain_logps(tiny_model(), round_) + shift) * round_.completion_mask
    return SamplerRecord(kind=kind, logps=logps, exact=exact)


def per_token(value: float) -> torch.Tensor:
    """`[B, T]` `value` on every completion token of the hand round, 0 on its padding."""
    return value * hand_round().completion_mask.float()


# ------------------------------------------------------------------------------------------------- decision 1


@pytest.mark.parametrize("correction", [None, TRUNCATE])
def test_an_exact_samplers_round_gets_no_weights_and_off_policy_its_sampler_s_log_probs(correction):
    """Row 1: the fast decoder's round (exact log-probs, + 0.25 nats from the plain forward's so that only the
    record can give them). On-policy: no old log-probs, no weights, no forward; off-policy the sampler's become the
    old ones as they are. The engine correction does not apply to it."""
    model = tiny_model()
    sampler = record("decoder", 0.25, exact=True)
    for schedule, old in ((ON_POLICY, None), (OFF_POLICY, sampler.logps)):
        corrections, scorer, _ = parts(OffPolicySettings(engine_correction=correction), schedule)
        with ForwardCount(model) as count:
            corrected, _ = corrections.correct(hand_round(sampler=sampler), "train", model, version=0)
            prepared = scorer.prepare(corrected, "train", model)
        assert count.calls == 0 and corrected.token_weights is None and corrected.old_logps is None
        assert (prepared.old_logps is None) if old is None else torch.equal(prepared.old_logps, old)


def test_an_engines_round_under_the_correction_is_weighted_by_the_trainers_over_the_engines_probability():
    """Row 2: the engine gave each token half the trainer's probability: rho = 2 per token, truncated to
    clip_max = 1.5; padding weighs 1 (log-ratio 0). The trainer's log-probs come from one no-grad forward: off-policy
    they are the old ones (not the engine's), on-policy they are dropped after use."""
    model = tiny_model()
    expected = per_token(1.5) + (1 - hand_round().completion_mask)  # 1.5 on tokens, 1 on padding
    for schedule in (ON_POLICY, OFF_POLICY):
        corrections, scorer, metrics = parts(OffPolicySettings(engine_correction=TRUNCATE), schedule)
        round_ = hand_round(sampler=record("engine", -math.log(2), exact=False))
        with ForwardCount(model) as count:
            corrected, _ = corrections.correct(round_, "train", model, version=0)
        assert count.calls == 1
        torch.testing.assert_close(corrected.token_weights, expected)
        difference = metrics["train"]["sampling/sampling_logp_difference/mean"]
        torch.testing.assert_close(difference[0], torch.tensor(math.log(2)))
        prepared = scorer.prepare(corrected, "train", model)
        if schedule is ON_POLICY:
            assert corrected.old_logps is None and prepared.old_logps is None
        else:
            torch.testing.assert_close(masked(prepared.old_logps, round_), plain_logps(model, round_))


def test_the_sequence_mask_mode_weighs_each_completion_by_the_product_of_its_tokens_ratios():
    """Row 2, `sequence_mask` with clip_max = 10: rho = 2^n for a completion of n tokens (rows of 5, 3, 4, 5
    tokens: 32, 8, 16, 32); 32 and 16 are above 10, so those completions weigh 0, and row 1 weighs 8 on every
    column."""
    model = tiny_model()
    corrections, _, _ = parts(OffPolicySettings(EngineCorrection("sequence_mask", None, 10.0)), OFF_POLICY)
    corrected, _ = corrections.correct(hand_round(sampler=record("engine", -math.log(2), exact=False)), "train",
                                       model, version=0)
    assert [2 ** n for n in LENGTHS] == [32, 8, 16, 32]
    torch.testing.assert_close(corrected.token_weights, torch.tensor([[0.0], [8.0], [0.0], [0.0]]).expand(4, 5))


@pytest.mark.parametrize("kind,logps", [("generate", False), ("engine", True)])
def test_otherwise_the_round_gets_no_weights_and_off_policy_old_log_probs_by_the_scorers_forward(kind, logps):
    """Row 3: a sampler without exact log-probs and no correction (`generate`, or an engine with the correction
    off): `OffPolicy` leaves the round as it is; off-policy `PolicyScorer.prepare` computes the old log-probs by a
    forward: the plain forward's, never the engine's (which stay in the record for the off-policy mask)."""
    model = tiny_model()
    sampler = record(kind, -math.log(2), exact=False) if logps else SamplerRecord(kind=kind)
    for schedule in (ON_POLICY, OFF_POLICY):
        corrections, scorer, _ = parts(OffPolicySettings(), schedule)
        round_ = hand_round(sampler=sampler)
        with ForwardCount(model) as count:
            corrected, _ = corrections.correct(round_, "train", model, version=0)
        assert count.calls == 0 and corrected.old_logps is None and corrected.token_weights is None
        prepared = scorer.prepare(corrected, "train", model)
        if schedule is ON_POLICY:
            assert prepared.old_logps is None
        else:
            torch.testing.assert_close(masked(prepared.old_logps, round_), plain_logps(model, round_))
        kept = prepared.sampler.logps
        assert (kept is None) if sampler.logps is None else torch.equal(kept, sampler.logps)


@pytest.mark.parametrize("correction", [None, TRUNCATE])
def test_a_round_sampled_ahead_with_behaviour_takes_its_samplers_log_probs_as_the_old_ones(correction):
    """Row 4 (`async_correction='behaviour'`): the behaviour policy's log-probs (the producer's, exact) are the old
    ones, kept through the preparation; no weights, even with the engine correction on; no forward."""
    model = tiny_model()
    sampler = record("decoder", -math.log(1.25), exact=True)
    corrections, scorer, _ = parts(OffPolicySettings(engine_correction=correction, ahead="behaviour"), AHEAD)
    with ForwardCount(model) as count:
        corrected, _ = corrections.correct(hand_round(sampler=sampler), "train", model, version=0)
        prepared = scorer.prepare(corrected, "train", model)
    assert count.calls == 0 and corrected.token_weights is None and not corrected.sampler.exact
    assert torch.equal(corrected.old_logps, sampler.logps) and torch.equal(prepared.old_logps, sampler.logps)


@pytest.mark.parametrize("correction,weight", [(None, None), (EngineCorrection("token_truncate", None, 3.0), 1.25)])
def test_a_round_sampled_ahead_with_recompute_gets_old_log_probs_at_its_start_weights(correction, weight):
    """Row 5 (`async_correction='recompute'`): old log-probs by one no-grad forward under the weights the round
    starts from (the plain forward's); the behaviour policy gave each token 1/1.25 of that probability, so the raw
    ratio pi_old / pi_b logged is 1.25 everywhere, and with the engine correction on it is each token's weight
    (within clip_max = 3; padding weighs 1)."""
    model = tiny_model()
    round_ = hand_round(sampler=record("decoder", -math.log(1.25), exact=True))
    corrections, scorer, metrics = parts(OffPolicySettings(engine_correction=correction, ahead="recompute"), AHEAD)
    with ForwardCount(model) as count:
        corrected, _ = corrections.correct(round_, "train", model, version=0)
    assert count.calls == 1
    torch.testing.assert_close(masked(corrected.old_logps, round_), plain_logps(model, round_))
    torch.testing.assert_close(metrics["train"]["async/importance_ratio_raw_mean"][0], torch.tensor(1.25))
    extremes = metrics.extremes("train", lambda values: values)  # one process: its own
    assert extremes["async/importance_ratio_raw_min"] == pytest.approx(1.25)
    assert extremes["async/importance_ratio_raw_max"] == pytest.approx(1.25)
    if weight is None:
        assert corrected.token_weights is None
    else:
        torch.testing.assert_close(corrected.token_weights, per_token(weight) + (1 - round_.completion_mask))
    prepared = scorer.prepare(corrected, "train", model)
    assert torch.equal(prepared.old_logps, corrected.old_logps)


def test_an_evaluation_round_is_never_treated_as_sampled_ahead():
    """`ahead` applies to training rounds only: an evaluation round of an asynchronous run is on-policy."""
    model = tiny_model()
    corrections, scorer, _ = parts(OffPolicySettings(ahead="behaviour"), AHEAD)
    corrected, _ = corrections.correct(hand_round(sampler=record("decoder", 0.0, exact=True)), "eval", model, 0)
    assert corrected.old_logps is None and scorer.prepare(corrected, "eval", model).old_logps is None
