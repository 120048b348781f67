"""The typed round: rows selected and padding columns trimmed for every field by its declared axis."""

import torch

from grpo_trainer.trainer.round import Round


def _round() -> Round:
    # 3 rows; prompts left-padded to S = 4 (row lengths 2, 3, 2: column 0 is padding everywhere); completions
    # right-padded to T = 4 (lengths 1, 2, 1: columns 2-3 are padding everywhere).
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    completion_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    prompt_ids = torch.arange(12).view(3, 4) * prompt_mask
    completion_ids = (torch.arange(12).view(3, 4) + 100) * completion_mask
    logps = torch.arange(12.0).view(3, 4)
    layer_outputs = torch.arange(3 * 2 * 8 * 1.0).view(3, 2, 8, 1)  # [B, L, S + T, E]
    return Round(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, advantages=torch.tensor([1.0, -1.0, 0.5]),
                 window_tokens=torch.tensor(4.0), old_logps=logps, sampling_probs=logps[..., None].expand(3, 4, 5),
                 layer_outputs=layer_outputs)


def test_trimmed_keeps_the_longest_prompt_and_completion_columns_of_every_field():
    round_ = _round()
    assert round_.kept_columns() == (1, 2)  # first real prompt column 1; longest completion 2 tokens
    trimmed = round_.trimmed()
    assert torch.equal(trimmed.prompt_ids, round_.prompt_ids[:, 1:])
    assert torch.equal(trimmed.completion_ids, round_.completion_ids[:, :2])
    assert torch.equal(trimmed.old_logps, round_.old_logps[:, :2])
    assert trimmed.sampling_probs.shape == (3, 2, 5)
    # sequence columns: prompt columns 1..3 then completion columns 0..1, i.e. columns 1..5 of S + T = 8
    assert torch.equal(trimmed.layer_outputs, round_.layer_outputs[:, :, 1:6])
    assert trimmed.advantages is round_.advantages and trimmed.window_tokens is round_.window_tokens
    assert trimmed.ref_logps is None and trimmed.sampling_logps is None


def test_token_level_advantages_are_trimmed_with_the_completion():
    round_ = _round()
    round_.advantages = torch.arange(12.0).view(3, 4)
    assert torch.equal(round_.trimmed().advantages, round_.advantages[:, :2])


def test_select_takes_rows_of_per_row_fields_and_shares_round_wide_ones():
    round_ = _round()
    picked = round_.select(torch.tensor([2, 0]))
    assert torch.equal(picked.advantages, torch.tensor([0.5, 1.0]))
    assert torch.equal(picked.layer_outputs, round_.layer_outputs[[2, 0]])
    assert picked.window_tokens is round_.window_tokens
    # rows 2 and 0 both have 2 prompt tokens and 1 completion token: their own trim is narrower
    assert picked.kept_columns() == (2, 1)


def test_split_shuffles_rows_into_equal_micro_batches_once():
    round_ = _round()
    assert round_.split(1) == [round_]
    torch.manual_seed(0)
    parts = _round_of(6).split(3)
    rows = torch.cat([p.advantages for p in parts]).sort().values
    assert [p.rows for p in parts] == [2, 2, 2] and torch.equal(rows, torch.arange(6.0))  # every row exactly once


def _round_of(rows: int) -> Round:
    ones = torch.ones(rows, 2, dtype=torch.long)
    return Round(prompt_ids=ones, prompt_mask=ones, completion_ids=ones, completion_mask=ones,
                 advantages=torch.arange(float(rows)), window_tokens=torch.tensor(1.0))


def test_env_mask_follows_its_rows_and_completion_columns_and_takes_tool_tokens_out_of_the_loss():
    round_ = _round()
    round_.env_mask = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 1], [0, 1, 1, 1]])  # 0: a tool wrote the token
    # loss mask = completion_mask * env_mask: row 1 keeps its first token only, row 2 none
    assert round_.loss_mask.tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    trimmed = round_.trimmed()  # trimming follows the completion (attention), not the loss mask
    assert torch.equal(trimmed.env_mask, round_.env_mask[:, :2])
    assert torch.equal(round_.select(torch.tensor([2, 0])).env_mask, round_.env_mask[[2, 0]])
    round_.env_mask = None
    assert round_.loss_mask is round_.completion_mask  # single-turn: nothing to combine
