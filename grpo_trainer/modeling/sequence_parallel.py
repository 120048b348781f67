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
3. Each process gets the log-prob of its positions' next tokens `[B, W / sp]` (through the chunked LM head);
   `gather_positions` joins the group's slices into `[B, W]` (differentiably), and `completion_columns` picks the
   completion tokens' `[B, T]` back: completion token `j` of row `b` sits at column `p_b + j` after step 1 (`p_b`
   its real prompt length), so it is predicted at column `p_b + j - 1`.

Every process of the group then holds the same `[B, T]` log-probs and computes the same loss from them; the
gradient reaching a process's slice is that process's share (see `gather_positions`).

Shapes: `B` rows, `S` prompt and `T` completion columns, `L = S + T`, `W` the padded width, `sp` the group's size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from grpo_trainer.modeling import logprobs
from grpo_trainer.modeling.forwards import ForwardSettings, installed
from grpo_trainer.modeling.unwrap import causal_lm

__all__ = ["SequenceShard", "completion_columns", "gather_positions", "leading_pads", "left_align", "padded_width",
           "ShardedScores", "activate", "deactivate", "install", "sharded_forwards", "sharded_scores"]


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


# The group whose Ulysses attention transformers' attention function runs as, while a sharded forward is active
# (None: the plain function). It stays set from a sharded policy forward through its backward, so a forward that
# gradient checkpointing recomputes in the backward shards the same way; `deactivate` ends it before any other
# forward (generation, the old and reference log-probs).
_state: dict = {"group": None, "instances": {}, "installed": set(), "forwards": 0}


def sharded_forwards() -> int:
    """How many sharded forwards this process ran (`sharded_scores`), for tests and logs."""
    return _state["forwards"]


def install(model: nn.Module, core: str = "sdpa") -> None:
    """Route transformers' `core` attention function through a switch: DeepSpeed's Ulysses attention (one instance
    per group and row count: its shapes are fixed per instance) while `activate`d, else the plain function.
    Ulysses takes no attention mask (plain causal: rows must be left-aligned, `SequenceShard`)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core in _state["installed"]:
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch_dist.get_backend())  # its comm layer wraps the running group
    config = causal_config(model)
    plain = ALL_ATTENTION_FUNCTIONS[core]

    def switched(module, query, key, value, attention_mask, *args, **kwargs):
        group = _state["group"]
        if group is None:
            return plain(module, query, key, value, attention_mask, *args, **kwargs)
        rows = query.shape[0]
        instance = _state["instances"].get((id(group), rows))
        if instance is None:
            instance = _state["instances"][(id(group), rows)] = UlyssesSPAttentionHF(
                attn=plain, batch_size=rows, attn_head_count=config.num_attention_heads,
                attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                kv_head_count=config.num_key_value_heads, num_hidden_layers=config.num_hidden_layers,
                process_group=group, seq_length_is_variable=True)
        return instance(module, query, key, value, None, *args, **kwargs)  # the local slice's mask: dropped

    ALL_ATTENTION_FUNCTIONS[core] = switched
    _state["installed"].add(core)


def activate(group) -> None:
    _state["group"] = group


def deactivate() -> None:
    _state["group"] = None


def causal_config(model: nn.Module):
    """The text config of `model` (a wrapper's inner model's)."""
    inner = getattr(model, "module", model)
    return inner.config.get_text_config()


class ShardedScores(NamedTuple):
    logps: Tensor  # [B, T]
    entropy: Tensor  # [B, T]


_UNSHARDED_DEFAULTS = ForwardSettings(padding_free=False)  # the sharded forward runs padded


def sharded_scores(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_length: int,
                   group=None, settings: ForwardSettings = _UNSHARDED_DEFAULTS, pad_token_id: int = 0
                   ) -> ShardedScores:
    """Log-probs and entropies `[B, T]` of the last `completion_length` tokens of `input_ids` `[B, S+T]`
    (left-padded prompts, right-padded completions), the forward split along positions over `group` with Ulysses
    attention (`install` first). Every process of the group must call it with the same rows; each gets the same
    result, differentiable through its own positions (`gather_positions`). The attention stays sharded until
    `deactivate` (its backward may recompute it). Values at padding positions are not meaningful (a loss masks
    them).

    The slice's positions are scored through the chunked LM head (`logprobs.ScoringHead`, `chunk_size` rows at a
    time) as the unsharded forward's are: `[B, W / sp, V]` float32 logits, their softmax and its product would be
    three times 4.9 GB at 8k positions of a 152k vocabulary. A model whose logits are not its head's output is
    scored from its own logits, chunk by chunk, when every process of the group finds so (a second forward: each
    forward is a collective under Ulysses, so the group takes one path). `settings`: the training forward's options
    (temperature, chunk size, the tied lookup; `mlp_tile_tokens`: each decoder layer's MLP computes that many of the
    slice's positions at a time, as ALST pairs Ulysses with TiledMLP), installed by `forwards.installed` as on the
    unsharded paths."""
    rank, size = torch_dist.get_rank(group), torch_dist.get_world_size(group)
    shard = SequenceShard.of(input_ids, attention_mask, input_ids.shape[1] - completion_length, rank, size,
                             pad_token_id)
    activate(group if group is not None else torch_dist.group.WORLD)
    _state["forwards"] += 1
    inputs = {"input_ids": shard.input_ids, "position_ids": shard.position_ids, "use_cache": False}
    lm = causal_lm(model)
    labels = shard.labels.reshape(-1)  # [B * W / sp]
    temperature, chunk_size = settings.temperature, settings.chunk_size
    with installed(lm, settings):  # open until the head has scored: the tied lookup takes its gradient
        out = model(**inputs, logits_to_keep=1, output_hidden_states=True)
        head = logprobs.scoring_head(model, out, chunk_size)
        agreed = _all_agree(head is not None, group, input_ids.device)
        if agreed:
            hidden = out.hidden_states[-1]  # [B, W / sp, H]
            logps, entropy = head.score(hidden.reshape(-1, hidden.shape[-1]), labels, temperature,
                                        with_entropy=True)[:2]
    if not agreed:
        del out
        with installed(lm, dataclasses.replace(settings, tied_lookup=False)):  # the model's own logits: no head
            logits = model(**inputs).logits  # [B, W / sp, V]
        logps, entropy = logprobs.logits_scores(logits.reshape(-1, logits.shape[-1]), labels, temperature, chunk_size)
    logps, entropy = logps.view(shard.labels.shape), entropy.view(shard.labels.shape)  # [B, W / sp]
    return ShardedScores(shard.completion(gather_positions(logps, group)),
                         shard.completion(gather_positions(entropy, group)))


def _all_agree(value: bool, group, device: torch.device) -> bool:
    """True when `value` is True on every process of `group` (`device`: where its backend reduces)."""
    flag = torch.tensor([int(value)], device=device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
