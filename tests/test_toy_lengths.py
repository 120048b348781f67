"""Scripted completion lengths (`tests/toy_lengths.py`): the EOS-forcing logits processor by hand, the seeded draws, and
the same lengths from `model.generate` (TRL's rollout) and this package's fast rollout."""

import math

import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import fast_rollout, greedy_config
from tests.toy_lengths import ForcedLengths, KeyedLengths, LogNormalLengths, install_lengths


def test_forced_lengths_by_hand():
    # Prompts of 3 columns; row 0 ends at token 2, row 1 at token 1; EOS ids 4 (forced) and 3.
    processor = ForcedLengths([2, 1], prompt_length=3, eos_ids=[4, 3])
    scores = torch.zeros(2, 5)
    step0 = processor(torch.zeros(2, 3, dtype=torch.long), scores)  # choosing token 1 of each completion
    inf = math.inf
    assert step0.tolist() == [[0, 0, 0, -inf, -inf], [-inf, -inf, -inf, -inf, 0]]
    step1 = processor(torch.zeros(2, 4, dtype=torch.long), scores)  # token 2: row 0 ends; row 1 already has
    assert step1.tolist() == [[-inf, -inf, -inf, -inf, 0], [0, 0, 0, 0, 0]]
    assert not scores.any()  # the input is left as it was


def test_draws_are_seeded_per_prompt_and_copy_and_clipped():
    lengths = LogNormalLengths(maximum=40, median=12, sigma=1.5, minimum=4, seed=3)
    prompt = (5, 6, 7)
    assert lengths.length(prompt, 0) == LogNormalLengths(40, 12, 1.5, 4, seed=3).length(prompt, 0)
    draws = [lengths.length((p,), c) for p in range(50) for c in range(4)]
    assert min(draws) == 4 and max(draws) == 40 and len(set(draws)) > 10  # sigma 1.5 reaches both bounds
    pad = 0
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 7, 8], [0, 5, 6, 7]])
    got = lengths.lengths(ids, pad)  # rows 0 and 2: the same prompt, copies 0 and 1
    assert got == [lengths.length(prompt, 0), lengths.length((5, 6, 7, 8), 0), lengths.length(prompt, 1)]


def test_generate_and_the_fast_rollout_end_at_the_same_drawn_lengths(tokenizer):
    model = make_tiny_model(tokenizer, seed=2)
    schedule = LogNormalLengths(maximum=12, median=5, sigma=0.6, minimum=1)
    install_lengths(model, schedule)
    prompts = tokenize_prompts(tokenizer, ["copy 123:", "copy 98765:", "c"] * 4, None)
    expected = schedule.lengths(prompts.ids, tokenizer.pad_token_id)
    assert len(set(expected)) > 3
    config = greedy_config(tokenizer, do_sample=True, max_new_tokens=12)
    torch.manual_seed(0)
    assert fast_rollout(model, prompts, config).completion_mask.sum(1).tolist() == expected
    out = model.generate(prompts.ids, attention_mask=prompts.mask, generation_config=config)
    assert (out[:, prompts.ids.shape[1]:] != tokenizer.pad_token_id).sum(1).tolist() == expected


def test_keyed_lengths_keep_a_resumed_rows_length():
    """Prompts of 3 tokens; a row's length is keyed on them and its first completion token, so a row re-fed with its
    first 2 completion tokens inside its "prompt" ends at the same step as the row decoded in one go."""
    schedule = LogNormalLengths(maximum=40, median=12, sigma=1.0, minimum=4, seed=1)
    processor = KeyedLengths(schedule, prompt_tokens=3, pad_token_id=0, eos_ids=[2])
    length = schedule.length((5, 6, 7), 9)  # prompt (5, 6, 7), first completion token 9
    inf = math.inf
    scores = torch.zeros(1, 4)
    first = processor(torch.tensor([[5, 6, 7]]), scores)  # choosing the first token: EOS forbidden
    assert first.tolist() == [[0, 0, -inf, 0]]
    for done in range(1, length):
        ids = torch.tensor([[0, 0, 5, 6, 7, 9] + [3] * (done - 1)])  # left padding, then done tokens so far
        expected = [[-inf, -inf, 0, -inf]] if done == length - 1 else [[0, 0, -inf, 0]]
        assert processor(ids, scores).tolist() == expected, done
    assert processor(torch.tensor([[5, 6, 7, 9] + [3] * length]), scores).tolist() == [[0, 0, 0, 0]]  # past it
