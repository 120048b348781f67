"""The typed round: rows selected and padding columns trimmed for every field by its declared axis."""

import torch

from grpo_trainer.rollout.types import KeptSupports, ReplayCapture, SamplerRecord
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
                 window_tokens=torch.tensor(4.0), old_logps=logps,
                 sampler=SamplerRecord(replay=ReplayCapture(logps[..., None].expand(3, 4, 5), layer_outputs)))


def test_trimmed_keeps_the_longest_prompt_and_completion_columns_of_every_field():
    round_ = _round()
    assert round_.kept_columns() == (1, 2)  # first real prompt column 1; longest completion 2 tokens
    trimmed = round_.trimmed()
    assert torch.equal(trimmed.prompt_ids, round_.prompt_ids[:, 1:])
    assert torch.equal(trimmed.completion_ids, round_.completion_ids[:, :2])
    assert torch.equal(trimmed.old_logps, round_.old_logps[:, :2])
    assert trimmed.sampler.replay.probs.shape == (3, 2, 5)
    # sequence columns: prompt columns 1..3 then completion columns 0..1, i.e. columns 1..5 of S + T = 8
    assert torch.equal(trimmed.sampler.replay.layer_outputs, round_.sampler.replay.layer_outputs[:, :, 1:6])
    assert trimmed.advantages is round_.advantages and trimmed.window_tokens is round_.window_tokens
    assert trimmed.ref_logps is None and trimmed.sampler.logps is None


def test_token_level_advantages_are_trimmed_with_the_completion():
    round_ = _round()
    round_.advantages = torch.arange(12.0).view(3, 4)
    assert torch.equal(round_.trimmed().advantages, round_.advantages[:, :2])


def test_select_takes_rows_of_per_row_fields_and_shares_round_wide_ones():
    round_ = _round()
    picked = round_.select(torch.tensor([2, 0]))
    assert torch.equal(picked.advantages, torch.tensor([0.5, 1.0]))
    assert torch.equal(picked.sampler.replay.layer_outputs, round_.sampler.replay.layer_outputs[[2, 0]])
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


def test_padded_pads_every_column_field_to_the_multiple_on_its_side():
    round_ = _round()  # S = 4, T = 4
    round_.pad_to_multiple_of = 3
    padded = round_.padded(pad_token_id=-1)
    # 4 -> 6 columns each: prompts gain 2 columns on the left, completions 2 on the right
    assert padded.prompt_ids.shape == padded.prompt_mask.shape == (3, 6)
    assert padded.completion_ids.shape == padded.old_logps.shape == (3, 6)
    assert torch.equal(padded.prompt_ids[:, :2], torch.full((3, 2), -1))  # token ids take the pad token id
    assert torch.equal(padded.prompt_ids[:, 2:], round_.prompt_ids)
    assert torch.equal(padded.completion_ids[:, 4:], torch.full((3, 2), -1))
    assert not padded.prompt_mask[:, :2].any() and not padded.completion_mask[:, 4:].any()
    assert torch.equal(padded.old_logps[:, :4], round_.old_logps) and not padded.old_logps[:, 4:].any()
    assert padded.sampler.replay.probs.shape == (3, 6, 5)
    # sequence columns: 2 new on the left (before the prompt), 2 on the right (after the completion) of S + T = 8
    assert padded.sampler.replay.layer_outputs.shape == (3, 2, 12, 1)
    assert torch.equal(padded.sampler.replay.layer_outputs[:, :, 2:10], round_.sampler.replay.layer_outputs)
    outputs = padded.sampler.replay.layer_outputs
    assert not outputs[:, :, :2].any() and not outputs[:, :, 10:].any()
    assert padded.advantages is round_.advantages


def test_trims_keep_widths_that_are_multiples():
    round_ = _round()  # real prompt columns 1..3 (3 wide), longest completion 2
    round_.pad_to_multiple_of = 2
    # prompt: 3 real columns -> 4 (a multiple of 2), i.e. from column 0; completion: 2 is already a multiple
    assert round_.kept_columns() == (0, 2)
    trimmed = round_.trimmed()
    assert trimmed.prompt_ids.shape == (3, 4) and trimmed.completion_ids.shape == (3, 2)
    assert trimmed.sampler.replay.layer_outputs.shape == (3, 2, 6, 1)
    assert trimmed.pad_to_multiple_of == 2 and trimmed.select(torch.tensor([0])).pad_to_multiple_of == 2
    # one row: prompt of 2 -> 2, completion of 1 -> 2 (never wider than the round: T = 4 here)
    assert round_.select(torch.tensor([0])).kept_columns() == (2, 2)
    round_.pad_to_multiple_of = 8  # wider than the round: the round's own widths, never more
    assert round_.kept_columns() == (0, 4)


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


def test_without_replay_drops_only_the_replay_tensors():
    round_ = _round()
    lean = round_.without_replay()
    assert lean.sampler.replay.probs is None and lean.sampler.replay.layer_outputs is None
    assert round_.sampler.replay.probs is not None  # the original is unchanged
    assert lean.old_logps is round_.old_logps and lean.completion_ids is round_.completion_ids


def test_the_sampler_record_follows_rows_and_columns_and_joins_by_the_oldest_version():
    round_ = _round()  # longest completion 2 of T = 4
    logps = torch.arange(12.0).view(3, 4)
    kept = torch.arange(24, dtype=torch.uint8).view(3, 4, 2)  # [B, T, ceil(V / 8)]
    round_.sampler = SamplerRecord("decoder", 3, logps, exact=True, kept=KeptSupports(mask=kept))
    picked = round_.select(torch.tensor([2, 0])).trimmed()
    assert torch.equal(picked.sampler.logps, logps[[2, 0], :1])  # rows 2 and 0 have 1 completion token
    assert torch.equal(picked.sampler.kept.mask, kept[[2, 0], :1])
    assert picked.sampler.kind == "decoder" and picked.sampler.version == 3 and picked.sampler.exact
    newer = Round(prompt_ids=round_.prompt_ids, prompt_mask=round_.prompt_mask, completion_ids=round_.completion_ids,
                  completion_mask=round_.completion_mask, sampler=SamplerRecord("decoder", version=5))
    joined = Round.concat([round_, newer], pad_token_id=0)
    # a tensor one part lacks is dropped; the oldest weights are the round's
    assert joined.sampler.logps is None and joined.sampler.kept.mask is None and joined.sampler.version == 3
    both = Round.concat([round_, round_], pad_token_id=0)
    assert torch.equal(both.sampler.logps, torch.cat([logps, logps])) and both.sampler.exact
