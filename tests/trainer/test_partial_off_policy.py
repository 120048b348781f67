"""`OffPolicy`'s decision 4 built alone (as test_off_policy_alone.py builds the others): a partial round's stale
tokens, those an earlier policy sampled (`SamplerRecord.versions` below the trained version), are weighted by
pi_old / pi_behaviour against their recorded log-probs, truncated per token, with the current policy's own tokens
weighted exactly 1, or masked out of the loss and its normaliser.

The recorded log-probs are set by hand relative to the plain forward's (pi_old at the round's start weights): a
stale token recorded half as likely as pi_old now finds it has rho = 2 (truncated to clip_max 1.5); one 1.25 times
more likely, rho = 0.8."""

import math

import pytest
import torch
from accelerate import Accelerator

from grpo_trainer.algorithms.engine_correction import EngineCorrection
from grpo_trainer.modeling.forwards import ForwardSettings
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.rollout.types import SamplerRecord
from grpo_trainer.trainer.off_policy import OffPolicy, OffPolicySettings
from grpo_trainer.trainer.schedule import Schedule
from grpo_trainer.trainer.scoring import PolicyScorer, ScoringSettings
from tests.trainer.parts_alone import ForwardCount, hand_round, plain_logps, tiny_model

TRUNCATE = EngineCorrection("token_truncate", clip_min=None, clip_max=1.5)
# rows of 5, 3, 4, 5 tokens: row 0 sampled at version 0 throughout, row 1's first 2 tokens at version 1, the rest
# of the round at version 2 (the version trained)
VERSIONS = torch.tensor([[0] * 5, [1, 1, 2, 2, 2], [2] * 5, [2] * 5])
STALE = VERSIONS < 2


def _parts(settings):
    scorer = PolicyScorer(ScoringSettings(ForwardSettings(padding_free=False)), Schedule(), None)
    metrics = MetricsWindow()
    return OffPolicy(settings, Schedule(), scorer.sampling_scores, Accelerator(cpu=True), metrics), metrics


def _partial_round(model):
    round_ = hand_round()
    old = plain_logps(model, round_)
    shift = torch.zeros_like(old)
    shift[0], shift[1] = -math.log(2), math.log(1.25)  # row 0: recorded half as likely; row 1: 1.25x more
    behaviour = (old + shift * STALE) * round_.completion_mask  # the current version's tokens: pi_old itself
    record = SamplerRecord("decoder", version=0, logps=behaviour, versions=VERSIONS)
    return hand_round(sampler=record)


def test_stale_tokens_are_weighted_by_the_hand_computed_ratio_and_fresh_ones_by_one():
    model = tiny_model()
    corrections, metrics = _parts(OffPolicySettings(partial="weight", partial_correction=TRUNCATE))
    round_ = _partial_round(model)
    with ForwardCount(model) as count:
        corrected, columns = corrections.correct(round_, "train", model, version=2)
    assert count.calls == 1 and columns == {}  # one no-grad forward at the round's start weights: pi_old
    expected = torch.ones(4, 5)
    expected[0] = 1.5  # rho = 2, truncated
    expected[1, :2] = 0.8
    torch.testing.assert_close(corrected.token_weights, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(corrected.token_weights[2:], torch.ones(2, 5))  # the current policy's tokens: exactly 1
    assert corrected.old_logps is None and corrected.sampler.versions is None  # on-policy: the loss's own
    logged = metrics["train"]
    stale, tokens = int((STALE * round_.completion_mask).sum()), int(round_.completion_mask.sum())
    assert logged["partial/stale_token_share"] == [pytest.approx(stale / tokens)]
    # staleness in optimizer steps behind: row 0's 5 tokens 2 behind, row 1's 2 tokens 1 behind
    assert logged["partial/staleness_mean"] == [pytest.approx((5 * 2 + 2 * 1) / 7)]
    assert metrics.maxima["train"]["partial/staleness_max"] == 2


def test_masked_stale_tokens_leave_the_loss_and_its_normaliser():
    model = tiny_model()
    corrections, _ = _parts(OffPolicySettings(partial="mask"))
    round_ = _partial_round(model)
    with ForwardCount(model) as count:
        corrected, _ = corrections.correct(round_, "train", model, version=2)
    assert count.calls == 0 and corrected.token_weights is None
    assert torch.equal(corrected.loss_mask, round_.completion_mask * (~STALE).int())
    assert torch.equal(corrected.completion_mask, round_.completion_mask)  # still in the context
    assert float(corrected.window_tokens) == float(corrected.loss_mask.sum())  # one process, one window


def test_a_round_with_no_stale_token_is_left_as_it_came():
    model = tiny_model()
    corrections, _ = _parts(OffPolicySettings(partial="weight", partial_correction=TRUNCATE))
    round_ = _partial_round(model)
    with ForwardCount(model) as count:
        corrected, _ = corrections.correct(round_, "train", model, version=0)  # every token at most this old
    assert count.calls == 0 and corrected.token_weights is None and corrected.env_mask is None
