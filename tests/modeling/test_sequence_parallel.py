"""The sequence-parallel layout, worked out by hand: left-aligning rows, padding the width to the group's size,
each process's slice of positions and labels, and where each completion token's log-prob comes back from. Then a
tiny model: the layout's mask-free forward scores the completion tokens exactly as the padded, masked one does."""

import pytest
import torch

from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.modeling.sequence_parallel import (
    SequenceShard,
    completion_columns,
    gather_positions,
    leading_pads,
    left_align,
    padded_width,
)

# Two rows, S = 3 prompt and T = 4 completion columns (L = 7), pad id 0:
#   row 0: prompt [pad 5 6]   completion [7 8 9 4]        1 left pad,  prompt length 2
#   row 1: prompt [pad pad 3] completion [2 pad pad pad]  2 left pads, prompt length 1
IDS = torch.tensor([[0, 5, 6, 7, 8, 9, 4], [0, 0, 3, 2, 0, 0, 0]])
MASK = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]])


def test_leading_pads_and_left_align_by_hand():
    assert leading_pads(MASK[:, :3]).tolist() == [1, 2]
    assert leading_pads(torch.tensor([[0, 0], [1, 0]])).tolist() == [2, 0]  # all pads; a trailing pad is not leading
    # Row 0 rolled left by 1: [5 6 7 8 9 4 | 0]; row 1 by 2: [3 2 0 0 0 | 0 0]; pads move to the end in order.
    assert left_align(IDS, torch.tensor([1, 2])).tolist() == [[5, 6, 7, 8, 9, 4, 0], [3, 2, 0, 0, 0, 0, 0]]
    assert left_align(torch.tensor([[1, 2, 3]]), torch.tensor([0])).tolist() == [[1, 2, 3]]
    # Trailing dimensions ride along: [B=1, L=3, 2] rolled by 1 column.
    values = torch.tensor([[[1, 10], [2, 20], [3, 30]]])
    assert left_align(values, torch.tensor([1])).tolist() == [[[2, 20], [3, 30], [1, 10]]]


def test_padded_width_and_completion_columns_by_hand():
    assert [padded_width(w, 2) for w in (7, 8, 1)] == [8, 8, 2]
    assert padded_width(7, 4) == 8 and padded_width(9, 4) == 12 and padded_width(5, 1) == 5
    # Completion token j of a row with prompt length p is left-aligned column p + j, predicted at p + j - 1.
    assert completion_columns(torch.tensor([2, 1]), 4).tolist() == [[1, 2, 3, 4], [0, 1, 2, 3]]


def test_each_process_gets_its_slice_of_positions_and_next_token_labels_by_hand():
    # Left-aligned rows (above) padded from L = 7 to W = 8 for sp = 2: four positions per process.
    #   row 0: [5 6 7 8 | 9 4 0 0], labels (the next column; 0 after the last) [6 7 8 9 | 4 0 0 0]
    #   row 1: [3 2 0 0 | 0 0 0 0], labels [2 0 0 0 | 0 0 0 0]
    # The last label of process 0 in row 0 is 9, the first token of process 1's slice: labels are shifted before
    # slicing.
    first, second = (SequenceShard.of(IDS, MASK, prompt_width=3, rank=r, sp_size=2) for r in (0, 1))
    assert first.input_ids.tolist() == [[5, 6, 7, 8], [3, 2, 0, 0]]
    assert second.input_ids.tolist() == [[9, 4, 0, 0], [0, 0, 0, 0]]
    assert first.labels.tolist() == [[6, 7, 8, 9], [2, 0, 0, 0]]
    assert second.labels.tolist() == [[4, 0, 0, 0], [0, 0, 0, 0]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3]] * 2 and second.position_ids.tolist() == [[4, 5, 6, 7]] * 2
    assert first.width == second.width == 8
    # Completion columns: row 0 (p = 2) at 1 2 3 4, row 1 (p = 1) at 0 1 2 3; the labels there are the completion
    # tokens: row 0 -> 7 8 9 4 (9 from process 0's last label, 4 from process 1's first), row 1 -> 2 then pads.
    labels = torch.cat([first.labels, second.labels], dim=1)  # [B, W], as gathered
    assert first.completion(labels).tolist() == [[7, 8, 9, 4], [2, 0, 0, 0]]
    # A gathered per-position value 10 b + w comes back as row 0 -> 1 2 3 4, row 1 -> 10 11 12 13.
    values = 10 * torch.arange(2)[:, None] + torch.arange(8)
    assert second.completion(values).tolist() == [[1, 2, 3, 4], [10, 11, 12, 13]]
    # A group of one: the whole padded width (no rounding needed), the same labels.
    whole = SequenceShard.of(IDS, MASK, prompt_width=3, rank=0, sp_size=1)
    assert whole.width == 7 and whole.labels.tolist() == [[6, 7, 8, 9, 4, 0, 0], [2, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="rank=2 is not in a sequence-parallel group of sp_size=2"):
        SequenceShard.of(IDS, MASK, prompt_width=3, rank=2, sp_size=2)


def test_gather_positions_of_a_group_of_one_is_the_slice_itself():
    local = torch.arange(6.0).view(2, 3).requires_grad_()
    gathered = gather_positions(local)
    (gathered * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(gathered, local) and local.grad.tolist() == [[1.0, 2.0, 3.0]] * 2


def test_the_left_aligned_mask_free_forward_scores_completions_as_the_padded_masked_one(tokenizer):
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tokenizer, seed=1).eval()
    ids = IDS.clone()
    ids[MASK.bool()] = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])  # tokens of the tiny vocabulary
    ids[~MASK.bool()] = tokenizer.pad_token_id
    reference = completion_logprobs(model, ids, MASK, completion_length=4).logps  # [B, T], padded and masked
    # The layout of a group of one, and the two slices of a group of two put side by side: both forwards run with
    # NO attention mask (as Ulysses does) over the whole left-aligned row.
    for sp_size in (1, 2):
        shards = [SequenceShard.of(ids, MASK, 3, r, sp_size, tokenizer.pad_token_id) for r in range(sp_size)]
        full = {k: torch.cat([getattr(s, k) for s in shards], dim=1) for k in ("input_ids", "position_ids", "labels")}
        with torch.no_grad():
            logits = model(input_ids=full["input_ids"], position_ids=full["position_ids"]).logits.float()
        position_logps = torch.log_softmax(logits, -1).gather(-1, full["labels"].unsqueeze(-1)).squeeze(-1)
        logps = shards[0].completion(position_logps)  # [B, T]
        completion_mask = MASK[:, 3:].bool()  # the real completion tokens: the only ones a loss reads
        assert torch.allclose(logps[completion_mask], reference[completion_mask], atol=1e-5)
        assert reference[completion_mask].abs().max() > 1.0  # log-probs of a random model: several nats


def test_a_mixture_of_experts_model_is_refused_by_the_sequence_group_before_anything_is_installed(tokenizer):
    """The sharded forward neither replays routes nor returns the router's auxiliary loss: a MoE model is refused by
    name (a dense one is accepted: `attach` then installs Ulysses, which needs a process group, so only the MoE
    refusal, which comes first, is checked in one process)."""
    from grpo_trainer.modeling import sequence_parallel
    from grpo_trainer.trainer.sequence_group import UlyssesGroup
    from tests.modeling.test_routing import moe_of_family

    with pytest.raises(ValueError, match=r"sp_size > 1 cannot train a Mixture-of-Experts model"):
        UlyssesGroup(2).check_model(moe_of_family(tokenizer, "qwen3_moe"))
    assert not sequence_parallel._state["installed"]  # refused before Ulysses replaced any attention function
