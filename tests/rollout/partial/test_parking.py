"""`rollout.partial.parking`: which groups a partial round starts, trains and parks, with hand-derived cases, and a
round driven end to end through a scripted decoder that keeps `RoundEnd`'s contract (each row's tokens fixed in
advance, so which rows end when is known by hand); the fast decoder's own end is tested in test_round_end.py."""

import copy

import pytest
import torch

from grpo_trainer.rollout.partial.parking import (
    PartialRollouts,
    extra_prompts,
    required_groups,
    trained_groups,
)
from grpo_trainer.rollout.partial.settings import PartialSettings
from grpo_trainer.rollout.types import PromptBatch, Rollout, SamplerRecord

EOS, PAD = 1, 0


def test_extra_prompts_fill_up_to_alpha_times_the_prompts():
    assert extra_prompts(parked=0, prompts=4, alpha=0.5) == 2
    assert extra_prompts(parked=1, prompts=4, alpha=0.5) == 1
    assert extra_prompts(parked=3, prompts=4, alpha=0.5) == 0  # more parked than alpha x P: no draw
    assert extra_prompts(parked=0, prompts=3, alpha=0.25) == 1  # ceil(0.75)
    assert extra_prompts(parked=0, prompts=4, alpha=0.0) == 0


def test_required_groups_are_the_oldest_at_the_cap_and_never_more_than_a_round_trains():
    assert required_groups([0, 2, 1, 3, 2], max_parks=2, needed=5) == [False, True, False, True, True]
    assert required_groups([3, 2, 2, 0], max_parks=2, needed=2) == [True, True, False, False]


def test_trained_groups_take_the_required_then_the_oldest_complete():
    complete = [True, False, True, True, True]
    required = [False, False, False, True, False]
    assert trained_groups(complete, required, 2) == [0, 3]  # 3 required, then 0 the oldest
    assert trained_groups(complete, [False] * 5, 3) == [0, 2, 3]
    with pytest.raises(RuntimeError, match="ended with 1 complete groups of the 2"):
        trained_groups([True, False], [False, False], 2)


class Scripted:
    """A decoder stand-in with the fast loop's contract: row r of a call continues `script[prompt]`, one token per
    step, until its script's EOS, its budget, or the call's `RoundEnd`; its log-prob of the token at position t of a
    script is -(t + 1) / 10, at any call. Counts its steps."""

    def __init__(self, scripts: dict[int, list[int]]):
        self.scripts, self.calls = scripts, []

    def __call__(self, prompts: PromptBatch) -> Rollout:
        end, B = prompts.end, prompts.ids.shape[0]
        rows = [prompts.ids[i][prompts.mask[i].bool()].tolist() for i in range(B)]
        done = [len(r) - 1 for r in rows]  # prompt: [key], then tokens so far
        self.calls.append(rows)
        finished = torch.zeros(B, dtype=torch.bool)
        out = [[] for _ in range(B)]
        for t in range(64):
            for i in range(B):
                if finished[i]:
                    out[i].append(PAD)
                    continue
                token = self.scripts[rows[i][0]][done[i] + t]
                out[i].append(token)
                finished[i] = token == EOS or t + 1 >= int(end.budgets[i])
            if bool(finished.all()) or end.reached(finished):
                break
        T = len(out[0])
        ids = torch.tensor(out)
        mask = torch.zeros(B, T, dtype=torch.int)
        logps = torch.zeros(B, T)
        for i in range(B):
            n = next((k + 1 for k, tok in enumerate(out[i]) if tok == EOS), T)
            mask[i, :n] = 1
            logps[i, :n] = torch.tensor([-(done[i] + k + 1) / 10 for k in range(n)])
        truncated = ~(ids == EOS).any(1)
        return Rollout(prompts.ids, prompts.mask, ids, mask, truncated, SamplerRecord("decoder", logps=logps))


def _script(length: int, key: int) -> list[int]:
    return [10 + key] * (length - 1) + [EOS]


def _round(partial, rows, version, scripted):
    return partial.round(rows, version, lambda dataset_rows: [[r["key"]] for r in dataset_rows], scripted, PAD, [EOS])


def test_a_long_group_is_parked_resumed_with_its_tokens_and_trained_whole():
    """Two prompts per round, G = 2, alpha 0.5: round 1 starts 3 groups (prompts 1 and 2, and prompt 7 from the
    stream, whose dataset holds only it); prompt 7's completions are 9 tokens long, the others 2-3. Round 1 ends
    when 2 groups are complete (step 3) and parks group 7 with 3 tokens in each row. Round 2 resumes them under
    version 1 (prompt + 3 tokens re-prefilled), ends at its 6th step when group 7 completes (after prompts 3 and 4,
    whose groups fill first), and trains group 7 with the oldest of the others: 7 is parked once, so not required;
    it is the oldest complete group. Its first 3 tokens keep version 0 and their log-probs."""
    scripts = {1: _script(2, 1), 2: _script(3, 2), 7: _script(9, 7), 3: _script(2, 3), 4: _script(8, 4)}
    partial = PartialRollouts(PartialSettings(alpha=0.5, max_parks=2), [{"key": 7}], num_generations=2,
                              max_completion_length=12, seed=0)
    scripted = Scripted(scripts)
    first = _round(partial, [{"key": 1}] * 2 + [{"key": 2}] * 2, 0, scripted)
    assert [r["key"] for r in first.rows] == [1, 1, 2, 2]
    assert first.metrics["partial/extra_prompts"] == 1 and first.metrics["partial/parked_groups"] == 1
    assert first.metrics["partial/decode_steps"] == 3 and first.metrics["partial/decoded_tokens"] == 2 * (2 + 3 + 3)
    parked = copy.deepcopy(partial.parked[0])
    assert parked.row["key"] == 7 and parked.parks == 1
    assert [r.tokens for r in parked.rows] == [[17, 17, 17]] * 2 and not any(r.ended for r in parked.rows)
    assert [r.versions for r in parked.rows] == [[0, 0, 0]] * 2
    second = _round(partial, [{"key": 3}] * 2 + [{"key": 4}] * 2, 1, scripted)
    assert scripted.calls[1][:2] == [[7, 17, 17, 17]] * 2  # resumed first: prompt and tokens so far
    assert second.metrics["partial/resumed_rows"] == 2 and second.metrics["partial/reprefilled_tokens"] == 6
    assert second.metrics["partial/extra_prompts"] == 0  # one group parked = ceil(0.5 x 2)
    assert second.metrics["partial/decode_steps"] == 6  # group 7 completes at its 9th token
    assert [r["key"] for r in second.rows] == [7, 7, 3, 3]  # the oldest complete group first; 4 is parked
    out = second.rollout
    for i in (0, 1):
        n = int(out.completion_mask[i].sum())
        assert out.completion_ids[i, :n].tolist() == _script(9, 7) and not bool(out.is_truncated[i])
        assert out.sampler.versions[i, :n].tolist() == [0, 0, 0] + [1] * 6
        torch.testing.assert_close(out.sampler.logps[i, :n], -torch.arange(1, 10) / 10)
    assert out.sampler.version == 0  # the oldest token's
    assert [g.row["key"] for g in partial.parked] == [4] and partial.parked[0].rows[0].tokens == [14] * 6


def test_a_group_at_the_cap_holds_the_round_open_until_it_completes():
    """max_parks = 1: group 7 parked once is required in round 2, which then decodes until it completes, though
    two other groups completed long before."""
    scripts = {1: _script(2, 1), 2: _script(2, 2), 7: _script(11, 7), 3: _script(2, 3), 4: _script(2, 4)}
    partial = PartialRollouts(PartialSettings(alpha=0.5, max_parks=1), [{"key": 7}], num_generations=2,
                              max_completion_length=12, seed=0)
    scripted = Scripted(scripts)
    _round(partial, [{"key": 1}] * 2 + [{"key": 2}] * 2, 0, scripted)
    assert partial.parked[0].row["key"] == 7 and partial.parked[0].rows[0].tokens == [17, 17]
    second = _round(partial, [{"key": 3}] * 2 + [{"key": 4}] * 2, 1, scripted)
    assert second.metrics["partial/decode_steps"] == 9  # 11 - 2 tokens: to group 7's end
    assert [r["key"] for r in second.rows] == [7, 7, 3, 3]


def test_a_row_cut_by_the_length_cap_ends_truncated():
    partial = PartialRollouts(PartialSettings(alpha=1.0), [{"key": 7}], num_generations=1, max_completion_length=4,
                              seed=0)
    out = _round(partial, [{"key": 1}], 0, Scripted({1: _script(9, 1), 7: _script(2, 7)}))
    assert [r["key"] for r in out.rows] == [7]  # the short one completes first
    assert partial.parked[0].rows[0].tokens == [11, 11]
    again = _round(partial, [{"key": 7}], 1, Scripted({1: _script(9, 1), 7: _script(9, 7)}))
    keys = [r["key"] for r in again.rows]
    assert keys == [1]  # resumed to the cap, 2 more tokens: complete (cut), the oldest
    assert again.rollout.completion_ids[0].tolist() == [11] * 4 and bool(again.rollout.is_truncated[0])


def test_the_state_round_trips_and_a_resumed_part_continues_identically():
    scripts = {1: _script(2, 1), 2: _script(3, 2), 7: _script(9, 7), 3: _script(2, 3), 4: _script(8, 4)}
    straight = PartialRollouts(PartialSettings(alpha=0.5), [{"key": 7}, {"key": 2}], 2, 12, seed=3)
    _round(straight, [{"key": 1}] * 2 + [{"key": 2}] * 2, 0, Scripted(scripts))
    state = copy.deepcopy(straight.state_dict())
    resumed = PartialRollouts(PartialSettings(alpha=0.5), [{"key": 7}, {"key": 2}], 2, 12, seed=3)
    resumed.load_state_dict(state)
    a = _round(straight, [{"key": 3}] * 2 + [{"key": 4}] * 2, 1, Scripted(scripts))
    b = _round(resumed, [{"key": 3}] * 2 + [{"key": 4}] * 2, 1, Scripted(scripts))
    assert a.rows == b.rows and a.metrics == b.metrics
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    assert torch.equal(a.rollout.sampler.versions, b.rollout.sampler.versions)
    assert straight.state_dict() == resumed.state_dict()


def test_rows_that_are_not_whole_groups_are_refused():
    partial = PartialRollouts(PartialSettings(alpha=0.5), [{"key": 1}], 4, 8, seed=0)
    with pytest.raises(ValueError, match="whole groups of num_generations=4"):
        _round(partial, [{"key": 1}] * 6, 0, Scripted({1: _script(2, 1)}))
