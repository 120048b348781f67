"""Padding-free layout of a micro-batch: its sequences' real tokens packed into rows, and the way back.

A trimmed micro-batch is `[B, S+T]`: each row a left-padded prompt then a right-padded completion, as wide as the
longest prompt plus the longest completion. Where completion lengths vary, much of it is padding, and every layer
computes on it. `PackedBatch.of` moves the real tokens into `R` rows of `W` tokens:

1. Plan: first-fit by length, decreasing (`first_fit_decreasing`): the longest sequence first, each into the first
   row it fits, up to a token budget per row; every row is then as wide as the widest. Wider rows leave less
   filler, but where attention is a dense `[W, W]` mask per row (SDPA and eager attention: every pair of a row is
   computed, masked or not) they cost attention quadratically. `plan` weighs both with the model's own numbers
   (`PackingCost`: work per token, through every layer's weights, and per pair of tokens in a row, through its
   attention) over budgets from the longest sequence to all of them, and keeps the cheapest; flash-attention's
   varlen kernel costs per sequence, not per row (no pair cost), so there one row holds everything.
2. Positions restart at 0 for each sequence, as the padded forward's `cumsum(mask) - 1` positions do. With no
   attention mask, no cache, and positions that restart, transformers' mask functions keep each sequence to itself
   (`masking_utils.find_packed_sequence_indices`); flash-attention gets `cu_seq_lens_q/k` and `max_length_q/k`
   instead (`flash_kwargs`). What is left of a row after its sequences is filled with token 0 at positions
   0, 1, ...: a sequence of its own that no real token sees (causality and the per-sequence mask).
3. Scored tokens: the completion tokens with attention mask 1, each predicted by the hidden state of the real token
   before it (`predictors`); their results go back to `[B, T]` at `targets`. Rows with no completion token are not
   packed at all; every position that is not scored gets 0.

Shapes: `B` rows and `S + T` columns of the padded batch, `T` completion columns, `R` packed rows of `W` tokens,
`N` scored tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Layout", "PackedBatch", "PackingCost", "PackingSettings", "first_fit_decreasing", "plan", "plan_of"]


@dataclass(frozen=True)
class PackingCost:
    """A forward's work in rows of `W` tokens: `token` per token (2 x the decoder layers' parameters: every linear),
    `pair` per pair of tokens in one row (4 x layers x attention width: scores and weighted values, dense), so
    `R x (token x W + pair x W^2)`. Only ratios matter. `pair` is 0 where attention costs per sequence (varlen)."""

    token: float = 1.0
    pair: float = 0.0

    def rows(self, count: int, width: int) -> float:
        return count * (self.token * width + self.pair * width * width)


@dataclass(frozen=True)
class PackingSettings:
    """How a micro-batch is packed."""

    token_budget: int | None = None  # tokens per row at most (None: `plan` chooses with `cost`)
    cost: PackingCost = PackingCost()
    pad_to_multiple_of: int | None = None  # row width rounded up to a multiple of this (TRL's option, for compilers)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `budget` tokens: longest first (ties in index order), each
    into the first row with room, a new row where none has. A length over `budget` gets a row of its own.

    >>> first_fit_decreasing([3, 5, 2, 4, 1], budget=6)
    [[1, 4], [3, 2], [0]]
    """
    rows: list[list[int]] = []
    room: list[int] = []
    shortest = min(lengths, default=0)
    open_rows: list[int] = []  # rows that can still take the shortest sequence, in order (first fit scans these)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        row = next((r for r in open_rows if room[r] >= length), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room.append(budget)
            open_rows.append(row)
        rows[row].append(index)
        room[row] -= length
        if room[row] < shortest:
            open_rows.remove(row)
    return rows


def _round_up(width: int, multiple: int | None) -> int:
    return width if multiple is None else -(-width // multiple) * multiple


# Candidate budgets, in multiples of the longest sequence (and all of them in one row).
_BUDGET_MULTIPLES = (1, 1.5, 2, 3, 4, 8)


def plan(lengths: Sequence[int], settings: PackingSettings) -> tuple[list[list[int]], int]:
    """Rows of sequence indices and their width: first-fit decreasing at `settings.token_budget`, or at the budget
    whose rows `settings.cost` finds cheapest (ties: fewer rows). A row is as wide as the fullest, rounded up."""
    if not lengths:
        return [[]], _round_up(1, settings.pad_to_multiple_of)
    longest, total = max(lengths), sum(lengths)
    budgets = [settings.token_budget] if settings.token_budget is not None else \
        sorted({*(b for b in (int(longest * m) for m in _BUDGET_MULTIPLES) if b < total), total})
    best = None
    for budget in budgets:
        rows = first_fit_decreasing(lengths, max(budget, longest))
        width = _round_up(max(sum(lengths[i] for i in row) for row in rows), settings.pad_to_multiple_of)
        key = (settings.cost.rows(len(rows), width), len(rows))
        if best is None or key < best[0]:
            best = (key, rows, width)
    return best[1], best[2]


@dataclass(frozen=True)
class Layout:
    """Which padded rows go into which packed row, and how wide the rows are: cheap to compute, so a caller can
    weigh it (`PackingCost.rows(*layout.shape)`) before building the `PackedBatch`."""

    rows: list[list[int]]  # padded row indices, per packed row, in order
    width: int  # W
    lengths: list[int]  # [B] real tokens of each padded row

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), self.width


def plan_of(attention_mask: Tensor, completion_length: int, settings: PackingSettings) -> Layout:
    """The `plan` of a padded micro-batch's sequences (`attention_mask` `[B, S+T]`), leaving out the rows with no
    completion token (nothing to score)."""
    lengths = attention_mask.sum(1).tolist()
    completions = attention_mask[:, attention_mask.shape[1] - completion_length:].sum(1).tolist()
    kept = [b for b in range(len(lengths)) if completions[b] > 0]
    rows, width = plan([lengths[b] for b in kept], settings)
    return Layout([[kept[i] for i in row] for row in rows], width, lengths)


@dataclass(frozen=True)
class PackedBatch:
    """A padded micro-batch's real tokens in packed rows, and where its scored tokens come from and go back to."""

    input_ids: Tensor  # [R, W] the sequences' tokens one after another, then filler (token 0)
    position_ids: Tensor  # [R, W] 0, 1, ... within each sequence and within the filler
    sources: tuple[Tensor, Tensor]  # ([R, W], [R, W]) padded (row, column) of each packed token; filler: (0, 0)
    predictors: Tensor  # [N] flat index into [R * W] of the hidden state that predicts each scored token
    targets: Tensor  # [N] flat index into [B * T] of each scored token
    target_cells: tuple[Tensor, Tensor]  # ([N], [N]) the same as (row, completion column)
    tokens: Tensor  # [N] the scored tokens
    sequence_lengths: tuple[int, ...]  # every sequence of every row in order, filler included (flash's cu_seq_lens)
    padded_shape: tuple[int, int, int]  # (B, S + T, T)
    real_tokens: int  # the packed sequences' tokens (the rest of R * W is filler)

    @property
    def tokens_computed(self) -> int:
        """Tokens each layer computes on: R * W (the padded batch: B * (S + T))."""
        return self.input_ids.numel()

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, completion_length: int,
           settings: PackingSettings = PackingSettings(), layout: Layout | None = None) -> PackedBatch:
        """Pack `input_ids` `[B, S+T]` (left-padded prompts, right-padded completions; `attention_mask` `[B, S+T]`
        1 for real tokens) whose last `completion_length` columns are completions, as `layout` says (default: the
        `plan_of` these masks under `settings`)."""
        B, width = input_ids.shape
        T = completion_length
        device = input_ids.device
        real = attention_mask.bool()  # [B, S+T]
        layout = plan_of(attention_mask, T, settings) if layout is None else layout
        rows, W, lengths = layout.rows, layout.width, layout.lengths
        used = [sum(lengths[b] for b in row) for row in rows]
        R = len(rows)
        # Each padded row's packed row and first column (-1: not packed).
        packed_row, offset = [-1] * B, [0] * B
        sequence_lengths: list[int] = []
        for r, row in enumerate(rows):
            start = 0
            for b in row:
                packed_row[b], offset[b] = r, start
                start += lengths[b]
                sequence_lengths.append(lengths[b])
            if start < W:
                sequence_lengths.append(W - start)
        packed_row, offset = torch.tensor(packed_row, device=device), torch.tensor(offset, device=device)
        # Every real token of a kept row: its padded (row, column), its rank k in its sequence, its packed cell.
        real = real & (packed_row >= 0)[:, None]
        rank = real.long().cumsum(1) - 1  # [B, S+T]
        b_index, c_index = real.nonzero(as_tuple=True)  # [M] each, row-major
        k = rank[b_index, c_index]
        p_row, p_col = packed_row[b_index], offset[b_index] + k
        # Filler: positions 0, 1, ... after each row's last sequence; token 0, source (0, 0). Where no row holds
        # two sequences, the filler continues its row's positions instead: every row then reads as one causal
        # sequence (a row's real tokens come first and never see the filler after them), so transformers finds no
        # packed sequences and SDPA runs causal without a dense [R, 1, W, W] mask (one sequence per micro-batch, or
        # long ones that the cost keeps apart, need none).
        columns = torch.arange(W, device=device)[None, :]  # [1, W]
        filled = torch.tensor(used if any(len(row) > 1 for row in rows) else [0] * R, device=device)[:, None]
        position_ids = (columns - filled).clamp(min=0).expand(R, W).clone()
        position_ids[p_row, p_col] = k
        packed_ids = input_ids.new_zeros(R, W)
        packed_ids[p_row, p_col] = input_ids[b_index, c_index]
        source_rows = torch.zeros(R, W, dtype=torch.long, device=device)
        source_cols = torch.zeros(R, W, dtype=torch.long, device=device)
        source_rows[p_row, p_col], source_cols[p_row, p_col] = b_index, c_index
        # Scored: completion columns, not a sequence's first token (nothing predicts it; a prompt never is empty).
        scored = (c_index >= width - T) & (k > 0)
        t_index = c_index[scored] - (width - T)
        return cls(input_ids=packed_ids, position_ids=position_ids, sources=(source_rows, source_cols),
                   predictors=p_row[scored] * W + p_col[scored] - 1, targets=b_index[scored] * T + t_index,
                   target_cells=(b_index[scored], t_index), tokens=input_ids[b_index[scored], c_index[scored]],
                   sequence_lengths=tuple(sequence_lengths), padded_shape=(B, width, T), real_tokens=int(k.numel()))

    def scatter(self, values: Tensor) -> Tensor:
        """`values` `[N, ...]` of the scored tokens in their `[B, T, ...]` places, 0 elsewhere, same dtype;
        differentiable."""
        B, _, T = self.padded_shape
        rest = values.shape[1:]
        return values.new_zeros(B * T, *rest).index_copy(0, self.targets, values).view(B, T, *rest)

    def gather(self, padded: Tensor) -> Tensor:
        """The scored tokens' entries `[N, ...]` of a `[B, T, ...]` tensor."""
        return padded[self.target_cells]

    def flash_kwargs(self) -> dict[str, Tensor | int]:
        """flash-attention's varlen arguments for the flattened rows: every sequence (filler included) on its own,
        as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them."""
        lengths = torch.tensor((0, *self.sequence_lengths), dtype=torch.int32)
        cu_seq_lens = lengths.cumsum(0, dtype=torch.int32).to(self.input_ids.device)
        longest = max(self.sequence_lengths)
        return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
                "max_length_k": longest}
