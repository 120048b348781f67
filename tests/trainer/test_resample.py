"""Dynamic sampling's placement rules (`trainer.resample`), without a model: which rows each process keeps, how many
extra prompts a round draws, and that the cap ends the search with a warning."""

import logging

import pytest
import torch

from grpo_trainer.data.sampler import PromptDraws
from grpo_trainer.trainer.resample import (
    Layout,
    Resampler,
    ResampleSettings,
    group_blocks,
    match_places,
    prompts_per_extra_round,
)


def test_group_blocks_split_a_group_across_the_processes_it_spans():
    # G = 4, 6 rows per process: group 0 = rows 0-3 on process 0; group 1 = rows 4-7: 4, 5 on process 0 (its rows
    # 4, 5) and 6, 7 on process 1 (its rows 0, 1); group 2 = rows 8-11: process 1's rows 2-5.
    assert group_blocks(3, 4, 6) == [((0, 0, 4),), ((0, 4, 2), (1, 0, 2)), ((1, 2, 4),)]


def test_places_take_the_first_unused_candidate_whose_rows_lie_alike():
    places = group_blocks(3, 4, 6)
    # an extra round of the same layout: its group 1 is the only one that also spans both processes
    candidates = group_blocks(3, 4, 6)
    assert match_places([0, 1, 2], places, [0, 1, 2], candidates) == {0: 0, 1: 1, 2: 2}
    assert match_places([1, 2], places, [0, 2], candidates) == {2: 2}  # nothing else spans like place 1
    # whole groups per process: any of a process's candidates fills any of its places, in order
    places = group_blocks(4, 2, 4)  # 2 groups per process
    candidates = group_blocks(2, 2, 2)  # 1 group per process
    assert match_places([0, 1, 3], places, [0, 1], candidates) == {0: 0, 3: 1}


def test_extra_round_sizes():
    layout = Layout(num_processes=2, process_index=0, num_generations=4)
    # 8 rows per process = 2 groups each. 3 empty places on process 1, 1 on process 0, half the groups seen
    # informative: ceil(3 / 0.5) = 6 prompts per process, capped at its 2 groups -> 2 x 2 = 4 prompts.
    assert prompts_per_extra_round(layout, 8, 4, [1, 3], 0.5) == 4
    # 16 rows (4 groups) per process, one empty place, 3/4 informative: ceil(1 / 0.75) = 2 per process -> 4
    assert prompts_per_extra_round(layout, 16, 8, [1, 0], 0.75) == 4
    assert prompts_per_extra_round(layout, 16, 8, [0, 1], 0.9) == 4  # ceil(1 / 0.9) = 2
    assert prompts_per_extra_round(layout, 16, 8, [0, 1], 1.0) == 2  # at least one prompt per process
    assert prompts_per_extra_round(layout, 16, 8, [4, 4], 0.0) == 8  # nothing informative yet: a full round
    # groups span processes (6 rows, G = 4): always the round's own layout, 3 prompts
    assert prompts_per_extra_round(layout, 6, 3, [1, 1], 0.5) == 3


class _Rows:
    """A dataset of `n` rows {"prompt": i}."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"prompt": i}


def _rewards_of(rows, saturated):
    """Rewards [len(rows), 1] of rows grouped G at a time: a saturated prompt's group is all 1, others 0, 1, 0, ..."""
    return torch.tensor([[1.0] if row["prompt"] in saturated else [float(i % 2)] for i, row in enumerate(rows)])


def test_fill_replaces_zero_variance_groups_with_the_draws_in_order():
    """One process, G = 2, 4 groups; prompts >= 10 are saturated (all rewards 1). The round is prompts 10, 1, 11, 2:
    places 0 and 2 are empty. The extra prompts are the stream PromptDraws(20, seed 3): 11, 0, 15, 10, 14, 1, 3, ...

    Extra round 1: 2 empty places, 2 of 4 groups informative so far -> ceil(2 / 0.5) = 4 prompts: 11, 0, 15, 10. Only
    prompt 0 (its group 1) is informative: it fills place 0. Extra round 2: 1 empty place, 3 of 8 groups informative
    -> ceil(1 / 0.375) = 3 prompts: 14, 1, 3. Prompt 1 (group 1) fills place 2; prompt 3 is left over."""
    dataset, G = _Rows(20), 2
    saturated = set(range(10, 20))
    resampler = Resampler(ResampleSettings(max_rounds=4), dataset, Layout(1, 0, G), 3,
                          lambda rewards: torch.tensor([bool(rewards[i] == rewards[i + 1])
                                                        for i in range(0, len(rewards), G)]))
    first = [{"prompt": p} for p in (10, 1, 11, 2) for _ in range(G)]
    drawn = []

    def sample(rows):
        drawn.append([row["prompt"] for row in rows[::G]])
        return _rewards_of(rows, saturated)

    selection = resampler.fill(_rewards_of(first, saturated), len(first), sample)
    assert drawn == [[11, 0, 15, 10], [14, 1, 3]]
    # (generation round, first row, rows) in the kept round's order: place 0 <- round 1's group 1, place 1 keeps
    # its rows, place 2 <- round 2's group 1, place 3 keeps its rows
    assert selection.blocks == [(1, 2, 2), (0, 2, 2), (2, 2, 2), (0, 6, 2)]
    assert selection.global_rows == [(1, 2), (1, 3), (0, 2), (0, 3), (2, 2), (2, 3), (0, 6), (0, 7)]
    # 4 + 4 + 3 prompts; zero-variance: 10, 11 | 11, 15, 10 | 14 = 6 of 11
    assert (selection.extra_rounds, selection.prompts_generated, selection.kept_zero_variance) == (2, 11, 0)
    assert selection.zero_variance_fraction == pytest.approx(6 / 11)
    assert resampler.state_dict()["position"] == 7


def test_fill_stops_at_the_cap_and_keeps_what_it_has_with_a_warning(caplog):
    dataset, G = _Rows(6), 2
    calls = []
    resampler = Resampler(ResampleSettings(max_rounds=3), dataset, Layout(1, 0, G), 0,
                          lambda rewards: torch.ones(len(rewards) // G, dtype=torch.bool))

    def sample(rows):
        calls.append(len(rows))
        return torch.ones(len(rows), 1)

    with caplog.at_level(logging.WARNING, logger="grpo_trainer.trainer.grpo_trainer"):
        selection = resampler.fill(torch.ones(4, 1), 4, sample)
    # nothing informative ever: each extra round is a full round (2 prompts, 4 rows); 3 of them, then stop
    assert calls == [4, 4, 4]
    assert selection.blocks == [(0, 0, 2), (0, 2, 2)]  # the round's own zero-variance groups stay
    assert (selection.extra_rounds, selection.prompts_generated, selection.kept_zero_variance) == (3, 8, 2)
    assert selection.zero_variance_fraction == 1.0
    assert "2 of 2 groups still have equal rewards after 3 extra generation rounds" in caplog.text


def test_prompt_draws_resume_where_they_stopped():
    stream = PromptDraws(7, seed=3)
    first = stream.draw(5)
    state = stream.state_dict()
    rest = stream.draw(12)  # crosses into the next permutations
    resumed = PromptDraws(7, seed=3)
    resumed.load_state_dict(state)
    assert resumed.draw(12) == rest
    assert sorted(first + rest[:2]) == list(range(7))  # one permutation, then the next
    with pytest.raises(ValueError, match="Resume with the same train_dataset and seed"):
        PromptDraws(8, seed=3).load_state_dict(state)
