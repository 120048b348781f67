"""The fast decoder's plain loop under partial rollouts' `RoundEnd`: a row stops at its budget, the loop stops once
enough groups (the required ones among them) are complete, and what the decoder cannot end early is refused by name.
EOS is suppressed (`suppress_tokens`), so every end here is a budget's or the rule's, known by hand."""

import dataclasses

import pytest
import torch

from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.types import RoundEnd
from tests.helpers import greedy_config, grouped_prompts, model_of_kind


def _end(budgets, groups, needed, required):
    return RoundEnd(torch.tensor(groups), needed, torch.tensor(required), torch.tensor(budgets))


def _rollout(model, tokenizer, end, max_new=8):
    prompts = dataclasses.replace(grouped_prompts(tokenizer), end=end)  # 3 prompts x 2 rows
    config = greedy_config(tokenizer, do_sample=True, temperature=1.0, max_new_tokens=max_new,
                           suppress_tokens=[tokenizer.eos_token_id])
    torch.manual_seed(0)
    return FastBackend().generate(model, prompts, config)


@pytest.fixture
def model(tokenizer):
    return model_of_kind("qwen2", tokenizer)


def test_without_an_end_rule_rows_run_to_the_cap_without_eos(model, tokenizer):
    out = _rollout(model, tokenizer, None)
    assert out.completion_ids.shape[1] == 8 and bool(out.is_truncated.all())


def test_the_loop_ends_once_enough_groups_are_complete(model, tokenizer):
    # group 0 (rows 0, 1) ends at step 3 (budgets 2 and 3), group 1 at 5, group 2 at 8
    end = _end([2, 3, 5, 4, 8, 8], [0, 0, 1, 1, 2, 2], needed=1, required=[False] * 3)
    assert _rollout(model, tokenizer, end).completion_ids.shape[1] == 3
    assert _rollout(model, tokenizer, dataclasses.replace(end, needed=2)).completion_ids.shape[1] == 5


def test_a_required_group_holds_the_loop_open(model, tokenizer):
    end = _end([2, 3, 5, 4, 8, 7], [0, 0, 1, 1, 2, 2], needed=1, required=[False, False, True])
    assert _rollout(model, tokenizer, end).completion_ids.shape[1] == 8


def test_a_row_takes_no_token_past_its_budget(model, tokenizer):
    end = _end([2, 3, 5, 4, 8, 8], [0, 0, 1, 1, 2, 2], needed=3, required=[False] * 3)
    out = _rollout(model, tokenizer, end)
    plain = _rollout(model, tokenizer, None)
    for row, budget in enumerate([2, 3, 5, 4, 8, 8]):
        # the same draws up to the budget (the loop draws every row every step), padding after it
        assert torch.equal(out.completion_ids[row, :budget], plain.completion_ids[row, :budget])
        assert (out.completion_ids[row, budget:] == tokenizer.pad_token_id).all()


def test_a_model_the_decoder_does_not_serve_is_refused_by_name(tokenizer):
    gpt2 = model_of_kind("gpt2", tokenizer)
    end = _end([4] * 6, [0, 0, 1, 1, 2, 2], needed=1, required=[False] * 3)
    with pytest.raises(ValueError, match="partial_rollouts ends a round inside the fast decoder's plain loop"):
        _rollout(gpt2, tokenizer, end)
