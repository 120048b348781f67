"""Sequence-parallel layout of a micro-batch: each process of a sequence-parallel (SP) group scores its own slice of
the positions (DeepSpeed Ulysses), and the slices' log-probs are put back together.

A trimmed micro-batch is `[B, S+T]`: each row a left-padded prompt then a right-padded completion, so a row's real
tokens are one run `[pads | prompt | completion | pads]`. Ulysses attention takes no attention mask (it exchanges
heads for positions and runs plain causal attention), so a real token would attend to the left pads before it;
`tests/distributed/test_ulysses_sp.py` measures that (0.38 nats). Hence:

1. Left-align (`left_align`): each row rolled left by its number of left pads, so its real tokens start at
   column 0 and every pad trails them. Under causal attention no real token sees a trailing pad, so the mask-free
   forward is exact for the real tokens, at positions `0, 1, ...` (the padded forward's `cumsum(mask) - 1`).
2. Pad the width to a multiple of the group's size (`padded_width`) and take this process's contiguous slice of
   positions (`SequenceShard.of`): `[B, W / sp]` token ids, positions and next-token labels. The labels are
   shifted BEFORE slicing, so the last position of one slice is scored against the first token of the next (as
   DeepSpeed's `UlyssesSPDataLoaderAdapter` does).
3. Each process gets the log-prob of its positions' next tokens `[B, W / sp]`; `gather_positions` joins the
   group's slices into `[B, W]` (differentiably), and `completion_columns` picks the completion tokens' `[B, T]`
   back: completion token `j` of row `b` sits at column `p_b + j` after step 1 (`p_b` its real prompt length), so it
   is predicted at column `p_b + j - 1`.

Every process of the group then holds the same `[B, T]` log-probs and computes the same loss from them; the
gradient reaching a process's slice is that process's share (see `gather_positions`).

Shapes: `B` rows, `S` prompt and `T` completion columns, `L = S + T`, `W` the padded width, `sp` the group's size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

__all__ = ["SequenceShard", "completion_columns", "gather_positions", "leading_pads", "left_align", "padded_width",
           "sharded_completion_logps", "ulysses_attention"]


def leading_pads(attention_mask: Tensor) -> Tensor:
    """`[B]` the number of padding columns before each row's first real token (a row of pads only: all of them)."""
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)


def left_align(values: Tensor, shift: Tensor) -> Tensor:
    """`[B, L, ...]` each row rolled left by `shift[b]` columns: column `i` takes column `(i + shift[b]) mod L`, so
    the `shift[b]` leading pads move to the end, in their order."""
    width = values.shape[1]
    columns = (torch.arange(width, device=values.device) + shift.to(values.device)[:, None]) % width  # [B, L]
    columns = columns.view(*columns.shape, *(1,) * (values.dim() - 2)).expand_as(values)
    return values.gather(1, columns)


def padded_width(width: int, sp_size: int) -> int:
    """The smallest multiple of `sp_size` that holds `width` columns (every process gets as many positions)."""
    return -(-width // sp_size) * sp_size


def completion_columns(prompt_lengths: Tensor, completion_length: int) -> Tensor:
    """`[B, T]` the left-aligned column whose next-token log-prob is completion token `j` of row `b`:
    `p_b + j - 1`, `p_b` the row's real prompt length (`p_b >= 1`: every prompt has a real token)."""
    return prompt_lengths[:, None] - 1 + torch.arange(completion_length, device=prompt_lengths.device)


@dataclass(frozen=True)
class SequenceShard:
    """One process's slice of a left-aligned micro-batch, and how its log-probs go back to `[B, T]`."""

    input_ids: Tensor  # [B, W / sp] this process's columns of the left-aligned, padded token ids
    position_ids: Tensor  # [B, W / sp] their global positions
    labels: Tensor  # [B, W / sp] the next token of each position (pad id after a row's last column)
    columns: Tensor  # [B, T] the column of the gathered [B, W] log-probs that scores each completion token
    width: int  # W

    @classmethod
    def of(cls, input_ids: Tensor, attention_mask: Tensor, prompt_width: int, rank: int, sp_size: int,
           pad_token_id: int = 0) -> SequenceShard:
        """`input_ids`, `attention_mask` `[B, S+T]` a trimmed micro-batch (`S = prompt_width` prompt columns);
        `rank` this process's index in the group of `sp_size`."""
        if not 0 <= rank < sp_size:
            raise ValueError(f"rank={rank} is not in a sequence-parallel group of sp_size={sp_size}")
        shift = leading_pads(attention_mask[:, :prompt_width])  # [B] left pads of each prompt
        aligned = left_align(input_ids, shift)  # [B, L]
        rows, length = aligned.shape
        width = padded_width(length, sp_size)
        filler = aligned.new_full((rows, width - length + 1), pad_token_id)  # padding, and the label after the last
        extended = torch.cat([aligned, filler], dim=1)  # [B, W + 1]
        local = slice(rank * width // sp_size, (rank + 1) * width // sp_size)
        positions = torch.arange(width, device=input_ids.device).expand(rows, width)
        columns = completion_columns(prompt_width - shift, input_ids.shape[1] - prompt_width)
        return cls(extended[:, :width][:, local], positions[:, local], extended[:, 1:][:, local], columns, width)

    def completion(self, position_values: Tensor) -> Tensor:
        """`[B, T]` the completion tokens' values from the gathered `[B, W]` per-position values."""
        return position_values.gather(1, self.columns)


class _GatherPositions(torch.autograd.Function):
    """All-gather along positions. Backward returns this process's slice of the incoming gradient, unreduced: every
    process of the group computes the SAME function of the gathered tensor, so each holds the whole gradient of
    that function already, and its slice is exactly the part that flows through its own positions."""

    @staticmethod
    def forward(ctx, local: Tensor, group, rank: int, size: int) -> Tensor:
        ctx.rank, ctx.width = rank, local.shape[1]
        pieces = [torch.empty_like(local) for _ in range(size)]
        torch_dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width], None, None, None


def gather_positions(local: Tensor, group=None) -> Tensor:
    """`[B, W]` the group's `[B, W / sp]` slices side by side, in rank order. Differentiable under the condition that
    makes sequence parallelism exact: every process of the group applies the same function to the result."""
    size = torch_dist.get_world_size(group) if torch_dist.is_initialized() else 1
    if size == 1:
        return local
    return _GatherPositions.apply(local, group, torch_dist.get_rank(group), size)


# (group, rows) -> DeepSpeed's Ulysses attention for micro-batches of that many rows (its shapes are fixed per
# instance; building one registers its group with the all-to-all operator, so each is built once).
_ulysses: dict[tuple[int, int], object] = {}


@contextlib.contextmanager
def ulysses_attention(model: nn.Module, group, rows: int, core: str = "sdpa") -> Iterator[None]:
    """Within: transformers' `core` attention function runs as DeepSpeed Ulysses over `group` (each process its
    slice of positions, all heads' full sequence after the all-to-all) for micro-batches of `rows` rows, without an
    attention mask (plain causal: the rows must be left-aligned, `SequenceShard`). Outside: the plain function, so
    generation and other forwards are untouched. The backward needs no registry (the exchanges are autograd
    functions), but a recomputed forward (gradient checkpointing) would run outside: the caller refuses that."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = causal_config(model)
    key = (id(group), rows)
    if key not in _ulysses:
        _ulysses[key] = UlyssesSPAttentionHF(
            attn=ALL_ATTENTION_FUNCTIONS[core], batch_size=rows, attn_head_count=config.num_attention_heads,
            attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            kv_head_count=config.num_key_value_heads, num_hidden_layers=config.num_hidden_layers,
            process_group=group, seq_length_is_variable=True)
    attention = _ulysses[key]

    def sharded(module, query, key, value, attention_mask, *args, **kwargs):
        return attention(module, query, key, value, None, *args, **kwargs)  # the mask is the local slice's: dropped

    plain = ALL_ATTENTION_FUNCTIONS[core]
    ALL_ATTENTION_FUNCTIONS[core] = sharded
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[core] = plain


def causal_config(model: nn.Module):
    """The text config of `model` (a wrapper's inner model's)."""
    inner = getattr(model, "module", model)
    return inner.config.get_text_config()


def sharded_completion_logps(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_length: int,
                             group=None, temperature: float = 1.0, pad_token_id: int = 0) -> Tensor:
    """`[B, T]` log-probs of the last `completion_length` tokens of `input_ids` `[B, S+T]` (left-padded prompts,
    right-padded completions), the forward split along positions over `group` with Ulysses attention. Every process
    of the group must call it with the same rows; each gets the same result, differentiable through its own
    positions (`gather_positions`). Values at padding positions are not meaningful (a loss masks them)."""
    rank, size = torch_dist.get_rank(group), torch_dist.get_world_size(group)
    shard = SequenceShard.of(input_ids, attention_mask, input_ids.shape[1] - completion_length, rank, size,
                             pad_token_id)
    with ulysses_attention(model, group, input_ids.shape[0]):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    logits = logits.float() / temperature  # [B, W / sp, V]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, shard.labels.unsqueeze(-1)).squeeze(-1)  # [B, W / sp]
    return shard.completion(gather_positions(logps, group))
