"""Drafts (`speculative.drafts`) and draft lengths (`speculative.policy`), by hand."""

import pytest

from grpo_trainer.rollout.speculative.drafts import START, Drafter, NgramIndex, PromptHistory
from grpo_trainer.rollout.speculative.policy import DraftPolicy, ForwardCost, expected_tokens, width
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings


def test_the_longest_suffix_found_gives_the_continuation():
    index = NgramIndex(max_match=3)
    index.add([1, 2, 3, 4, 5, 2, 3, 9])
    # "2 3" ends twice: the later occurrence continues [9] (the sequence ends), the earlier [4, 5]: the longest wins
    assert index.continuation([7, 2, 3], 2) == (2, [4, 5])
    assert index.continuation([1, 2, 3], 3) == (3, [4, 5, 2])  # the 3-gram "1 2 3" wins over "2 3"
    assert index.continuation([1, 2, 3], 3, longest=2) == (2, [4, 5, 2])
    assert index.continuation([8], 3) == (0, [])  # not found
    assert index.continuation([5], 10) == (1, [2, 3, 9])  # cut at the sequence's end


def test_the_longest_match_wins_and_sources_break_ties_in_order():
    settings = SpeculativeSettings(max_match=2)
    history = PromptHistory(settings)
    prompt = (40, 41, 42, 43)
    history.add(prompt, [[10, 11, 12, 1]])
    drafter = Drafter(settings, groups=[0, 0], prompts=[prompt], history=history)
    # Nothing committed yet: the first tokens come from the history's completion (its START), no sibling has any.
    assert drafter.draft(0, 3) == [10, 11, 12]
    drafter.commit(1, [10, 20, 21, 22])  # row 1 went another way
    assert drafter.draft(0, 3) == [10, 20, 21]  # START 10 matches both: at equal length the sibling wins
    drafter.commit(0, [10, 11])  # row 0 follows the history: "10 11" (2 tokens) there, only "11" nowhere else
    assert drafter.draft(0, 3) == [12, 1]
    drafter.commit(0, [42])
    assert drafter.draft(0, 5) == [43]  # only the prompt has "42": prompt lookup
    assert drafter.draft(0, 0) == []
    drafter.commit(1, [42, 7])  # now the sibling has "42" too, followed by 7; the prompt's 43 has the same match
    assert drafter.draft(0, 1) == [7]  # equal length (1): the group source comes first
    drafter.remember([[10, 11, 42, 1], [10, 20, 21, 22, 42, 7, 1]])
    later = Drafter(settings, groups=[0], prompts=[prompt], history=history)
    assert later.draft(0, 2) == [10, 20]  # the most recent completion with the longest continuation
    assert START not in later.draft(0, 50)


def test_history_keeps_the_latest_completions_within_its_token_budget():
    settings = SpeculativeSettings(max_match=1, history_per_prompt=2, history_tokens=6)
    history = PromptHistory(settings)
    history.add((1,), [[5, 6]])
    history.add((1,), [[7, 8], [9, 10]])  # three completions: the oldest drops out
    assert [s[1:] for s in history.index((1,)).sequences] == [[7, 8], [9, 10]]
    assert history.tokens == 4
    history.add((2,), [[3]])
    history.index((1,))  # prompt 1 drafted: prompt 2 is the least recently used
    history.add((3,), [[4, 4]])  # 4 + 1 + 2 = 7 tokens > 6: prompt 2 goes
    assert history.index((2,)) is None and history.index((1,)) is not None and history.index((3,)) is not None
    assert history.tokens == 6
    history.add((1,), [[11]])  # a new completion: the cached index is rebuilt at its next use
    assert [s[1:] for s in history.index((1,)).sequences] == [[9, 10], [11]]


def test_an_index_costs_about_a_kilobyte_per_token_and_the_kept_tokens_four_bytes():
    """Decision 5's figures, measured: what the history keeps between rounds is its tokens."""
    import random
    import tracemalloc

    rng = random.Random(0)
    completions = [[rng.randrange(30_000) for _ in range(500)] for _ in range(16)]
    tracemalloc.start()
    try:
        index = NgramIndex(4)
        for completion in completions:
            index.add([START, *completion])
        per_token = tracemalloc.get_traced_memory()[0] / 8_000
        del index
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        history = PromptHistory(SpeculativeSettings(history_per_prompt=16))
        history.add(tuple(range(10)), completions)
        kept = (tracemalloc.get_traced_memory()[0] - base) / 8_000
    finally:
        tracemalloc.stop()
    assert 300 < per_token < 2_000
    assert kept < 8


def test_draft_lengths_grow_back_off_and_pause():
    policy = DraftPolicy(SpeculativeSettings(max_draft_tokens=8, max_verify_tokens=64), rows=1)
    assert policy.limits([0], [100]) == [4]
    policy.update([0], [4], [4])  # all held: doubles
    assert policy.limits([0], [100]) == [8]
    policy.update([0], [8], [8])
    assert policy.limits([0], [100]) == [8]  # capped
    assert policy.limits([0], [3]) == [3]  # the length cap
    policy.update([0], [8], [2])  # partial: what held plus one
    assert policy.limits([0], [100]) == [3]
    policy.update([0], [3], [0])  # none held: halves
    assert policy.limits([0], [100]) == [1]
    policy.update([0], [1], [0])  # none held at one token: a pause of one forward
    assert policy.limits([0], [100]) == [0]
    policy.update([0], [0], [0])
    assert policy.limits([0], [100]) == [1]  # tries one token again
    policy.update([0], [1], [0])  # and misses: the next pause is twice as long
    for _ in range(2):
        assert policy.limits([0], [100]) == [0]
        policy.update([0], [0], [0])
    assert policy.limits([0], [100]) == [1]


def test_a_full_batch_drafts_less_than_its_tail():
    policy = DraftPolicy(SpeculativeSettings(max_draft_tokens=8, max_verify_tokens=32), rows=16)
    assert policy.limits(list(range(16)), [100] * 16) == [1] * 16  # 32 positions over 16 rows: 1 draft token
    assert policy.limits(list(range(32 // 3)), [100] * 10) == [2] * 10
    assert policy.limits([3, 7], [100, 100]) == [4, 4]  # the tail: the row's own length (4 at the start)
    assert DraftPolicy(SpeculativeSettings(max_verify_tokens=16), rows=17).limits(list(range(17)), [9] * 17) == \
        [0] * 17  # fewer positions than rows: no drafts


def test_expected_tokens_of_a_geometric_run():
    assert expected_tokens(0, 0.5) == 1
    assert expected_tokens(3, 0.5) == 1 + 0.5 + 0.25 + 0.125


def test_acceptance_counts_held_tokens_against_missed_drafts():
    policy = DraftPolicy(SpeculativeSettings(), rows=2)
    assert policy.acceptance([0, 1]) == [0.5, 0.5]  # nothing seen: the prior's 1 / 2
    policy.update([0], [4], [4])  # 4 held, no miss
    policy.update([0], [8], [2])  # 2 held, then a miss
    # row 0: 6 held, 1 miss; the round: prior (6 + 1) / (7 + 2) = 7 / 9, weighted as two drafts
    assert policy.acceptance([0, 1]) == pytest.approx([(6 + 14 / 9) / (7 + 2), 14 / 9 / 2])


def test_the_width_follows_the_measured_cost():
    lengths, acceptance = [3, 3], [0.5, 0.5]
    assert width(lengths, acceptance, ForwardCost()) == 4  # nothing timed: what the rows drafted
    flat = ForwardCost()
    flat.observe(4, 1.0)
    flat.observe(8, 1.0)  # positions are free (memory-bound): the widest forward
    assert flat.coefficients() == pytest.approx((1.0, 0.0))
    assert width(lengths, acceptance, flat) == 4
    linear = ForwardCost()
    linear.observe(4, 4.0)
    linear.observe(8, 8.0)  # every position costs its share (compute-bound): 1 + p + ... < Q, never worth it
    assert linear.coefficients()[1] == pytest.approx(1.0)
    assert width(lengths, [0.99, 0.99], linear) == 1
    mixed = ForwardCost()
    mixed.observe(2, 1.2)
    mixed.observe(8, 1.8)  # a = 1, b = 0.1: with N = 2, Q = 2 costs 1.4 for 2 x 1.5 tokens, Q = 1 1.2 for 2
    assert width(lengths, acceptance, mixed) == 3  # 2 x 1.75 / 1.6 = 2.19 per second beats 2.14 (Q=2), 1.67 (Q=1)
    for _ in range(30):  # plain forwards 2 to 31 in a row
        assert width(lengths, [0.01, 0.01], linear) == 1
    assert width(lengths, [0.01, 0.01], linear) == 2  # the 32nd: a wider one is timed instead
