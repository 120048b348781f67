"""A generation round as the loss consumes it: one typed object from the rollout to the last micro-step.

Decisions:

1. A `Round` holds every per-row tensor the loss reads, each field documented with its shape. Fields declare which
   axis of columns they span (`columns` metadata): prompt columns, completion columns, or the whole sequence. So
   selecting rows and trimming padding are written once, for every field, present and future.
2. A round is shuffled once and cut into `steps_per_generation` micro-batches (advantages are already computed, so
   groups no longer need to stay together), and each micro-batch is trimmed to its own longest prompt and
   completion once, before any forward pass: a micro-batch of short completions does not pay for the round's
   longest one.
3. A field may also hold an `ImageInputs` (`rollout.types`), which selects its own rows and columns (`select_rows`,
   `select_columns`, `pad_columns`): a vision-language model's image inputs, whose image tensors
   do not have one entry per row, and whose token fields span the prompt columns.
4. With `pad_to_multiple_of` (TRL's option, for compilers that build one graph per input shape), the round's
   prompt and completion widths are padded once to multiples of it (`padded`), and every trim keeps multiples:
   it rounds the kept prompt and completion widths up, never past the round's own.
5. The sampler's values (log-probs, kept supports, replay capture) are one `SamplerRecord` (`rollout.types`), whose
   tensors select, trim, pad and concatenate with the round's.

Shapes: `B` rows, `S` prompt tokens, `T` completion tokens, `L` decoder layers, `E` hidden size, `V` vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_trainer.rollout.types import ImageInputs, ReplayCapture, Rollout, SamplerRecord

__all__ = ["Round"]

_PROMPT, _COMPLETION, _SEQUENCE, _RECORD = "prompt", "completion", "sequence", "record"


def _columns(axis: str, dim: int = 1, token_ids: bool = False) -> Any:
    return field(default=None, metadata={"columns": axis, "dim": dim, "token_ids": token_ids})


def _round_up(width: int, multiple: int | None) -> int:
    return width if multiple is None else -(-width // multiple) * multiple


@dataclass
class Round:
    """One process's share of a generation round (or one micro-batch of it)."""

    prompt_ids: Tensor = _columns(_PROMPT, token_ids=True)  # [B, S] left-padded
    prompt_mask: Tensor = _columns(_PROMPT)  # [B, S]
    completion_ids: Tensor = _columns(_COMPLETION, token_ids=True)  # [B, T] right-padded
    completion_mask: Tensor = _columns(_COMPLETION)  # [B, T] int: the completion's tokens (after every loss mask)
    # Multi-turn: 1 for tokens the policy sampled, 0 for tokens a tool or environment wrote, which stay in the
    # context (attention) but never in the loss. None: every completion token was sampled.
    env_mask: Tensor | None = _columns(_COMPLETION)  # [B, T] int
    advantages: Tensor = field(default=None)  # [B] or [B, T] (a [B, T] one is trimmed with the completion)
    # The `dapo`/`cispo` normaliser: active tokens per process per gradient-accumulation window, `[]`.
    window_tokens: Tensor | None = None
    old_logps: Tensor | None = _columns(_COMPLETION)  # [B, T] pi_old, when the round outlives an optimizer step
    ref_logps: Tensor | None = _columns(_COMPLETION)  # [B, T] the reference model's, when beta != 0
    # Each token's importance weight against its sampler (`trainer.off_policy`: an engine's correction,
    # `algorithms.engine_correction`, broadcast over a completion's tokens in the sequence modes); None: none.
    token_weights: Tensor | None = _columns(_COMPLETION)  # [B, T]
    # A vision-language model's image inputs for these rows (decision 3); None for text prompts.
    images: ImageInputs | None = _columns(_PROMPT)
    # How the round was sampled (decision 5): the sampler's log-probs, kept supports, replay capture.
    sampler: SamplerRecord = field(default_factory=lambda: SamplerRecord(), metadata={"columns": _RECORD})
    # Keep S and T multiples of this (decision 4); None: trims keep exactly the columns some row uses.
    pad_to_multiple_of: int | None = None

    @classmethod
    def from_rollout(cls, out: Rollout, images: ImageInputs | None, advantages: Tensor, loss_mask: Tensor,
                     window_tokens: Tensor, pad_to_multiple_of: int | None, pad_token_id: int) -> Round:
        """A round from a rollout `out` of prompts with `images`: its tokens, masks and sampler values, with the
        round's advantages `[B]`, its loss mask `[B, T]` (the completion mask after every loss mask but the tools'),
        and its normaliser; padded as decision 4 says."""
        return cls(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                   completion_mask=loss_mask.int(), env_mask=out.env_mask, advantages=advantages,
                   window_tokens=window_tokens, images=images, sampler=out.sampler,
                   pad_to_multiple_of=pad_to_multiple_of).padded(pad_token_id)

    @property
    def rows(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def loss_mask(self) -> Tensor:
        """`[B, T]` the tokens the loss scores: the completion's, less those a tool wrote."""
        return self.completion_mask if self.env_mask is None else self.completion_mask * self.env_mask

    def select(self, index: slice | Tensor) -> Round:
        """The rows `index` of every per-row field; the round-wide normaliser is shared."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            per_row = isinstance(value, Tensor) and value.dim() > 0 or isinstance(value, (ImageInputs, SamplerRecord))
            values[f.name] = (value[index] if isinstance(value, Tensor) else value.select_rows(index)) \
                if per_row else value
        return Round(**values)

    def without_replay(self) -> Round:
        """This round without its replay capture (`SamplerRecord.replay`): what a buffered micro-batch keeps once its
        last loss has run, so it does not outlive its backward pass."""
        return dataclasses.replace(self, sampler=dataclasses.replace(self.sampler, replay=ReplayCapture()))

    def split(self, parts: int, generator: torch.Generator | None = None) -> list[Round]:
        """Shuffle the rows and cut `parts` equal micro-batches (one part: the round itself, no copy). `generator`:
        a CPU generator to shuffle with (default torch's global one)."""
        if parts == 1:
            return [self]
        device = self.completion_ids.device
        order = torch.randperm(self.rows, device=device) if generator is None \
            else torch.randperm(self.rows, generator=generator).to(device)
        size = self.rows // parts
        return [self.select(order[i * size:(i + 1) * size]) for i in range(parts)]

    def kept_columns(self) -> tuple[int, int]:
        """The first prompt column and the completion length that `trimmed` keeps (decision 4 included)."""
        S, T = self.prompt_ids.shape[1], self.completion_ids.shape[1]
        first = int(self.prompt_mask.any(0).int().argmax())
        last = max(int(self.completion_mask.sum(1).max()), 1)
        multiple = self.pad_to_multiple_of
        return S - min(_round_up(S - first, multiple), S), min(_round_up(last, multiple), T)

    def _column_fields(self) -> list[tuple[dataclasses.Field, Any, str]]:
        """(field, value, axis) of every field that has columns, token-level advantages included: tensors, and
        objects that select their own columns (decision 3)."""
        found = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            axis = f.metadata.get("columns")
            if f.name == "advantages" and isinstance(value, Tensor) and value.dim() == 2:
                axis = _COMPLETION  # token-level advantages
            if axis is not None and isinstance(value, (Tensor, ImageInputs, SamplerRecord)):
                found.append((f, value, axis))
        return found

    def sequences(self) -> tuple[Tensor, Tensor, int]:
        """The rows as a log-prob forward takes them: token ids and attention mask `[B, S + T]`, and T."""
        return (torch.cat([self.prompt_ids, self.completion_ids], dim=1),
                torch.cat([self.prompt_mask, self.completion_mask], dim=1), self.completion_ids.shape[1])

    def trimmed(self) -> Round:
        """This round without the columns that are padding in every row: left of the longest prompt, right of the
        longest completion (at least one completion column is kept; widths rounded up as decision 4 says)."""
        first, last = self.kept_columns()
        width = self.prompt_ids.shape[1]
        keep = {_PROMPT: slice(first, None), _COMPLETION: slice(0, last), _SEQUENCE: slice(first, width + last)}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f, value, axis in self._column_fields():
            if not isinstance(value, Tensor):
                values[f.name] = value.select_columns(keep if axis == _RECORD else keep[axis])
                continue
            values[f.name] = value[(slice(None),) * f.metadata.get("dim", 1) + (keep[axis],)]
        return Round(**values)

    def padded(self, pad_token_id: int) -> Round:
        """This round with its prompt columns padded on the left and its completion columns on the right to
        multiples of `pad_to_multiple_of` (itself when None): token ids with `pad_token_id`, every other field
        (masks, log-probs, replay tensors) with zeros."""
        S, T = self.prompt_ids.shape[1], self.completion_ids.shape[1]
        return self._widened(_round_up(S, self.pad_to_multiple_of), _round_up(T, self.pad_to_multiple_of),
                             pad_token_id)

    def _widened(self, prompt_width: int, completion_width: int, pad_token_id: int) -> Round:
        """This round padded to `prompt_width` prompt and `completion_width` completion columns (decision 4's
        fill values); itself when it is that wide already."""
        S, T = self.prompt_ids.shape[1], self.completion_ids.shape[1]
        left, right = prompt_width - S, completion_width - T
        if left == right == 0:
            return self
        sides = {_PROMPT: (left, 0), _COMPLETION: (0, right), _SEQUENCE: (left, right)}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f, value, axis in self._column_fields():
            if not isinstance(value, Tensor):
                values[f.name] = value.pad_columns(sides if axis == _RECORD else sides[axis])
                continue
            dim = f.metadata.get("dim", 1)
            # F.pad counts its (left, right) pairs from the last dimension backwards
            widths = (0, 0) * (value.dim() - dim - 1) + sides[axis]
            fill = pad_token_id if f.metadata.get("token_ids") else 0
            values[f.name] = torch.nn.functional.pad(value, widths, value=fill)
        return Round(**values)

    @classmethod
    def concat(cls, parts: list[Round], pad_token_id: int) -> Round:
        """The rows of `parts` in order, as one round (dynamic sampling's rounds are assembled from several
        generation rounds): every part widened to the widest prompt and completion (decision 4 kept), then each
        per-row field concatenated. A field some parts lack is dropped (None), except `env_mask`, whose None means
        "every token sampled" (ones). The normaliser (`window_tokens`) is the caller's to set."""
        if len(parts) == 1:
            return dataclasses.replace(parts[0], window_tokens=None)
        multiple = parts[0].pad_to_multiple_of
        S = _round_up(max(p.prompt_ids.shape[1] for p in parts), multiple)
        T = _round_up(max(p.completion_ids.shape[1] for p in parts), multiple)
        if any(p.env_mask is not None for p in parts):
            parts = [p if p.env_mask is not None else dataclasses.replace(p, env_mask=torch.ones_like(
                p.completion_mask)) for p in parts]
        parts = [p._widened(S, T, pad_token_id) for p in parts]
        values: dict[str, Any] = {"pad_to_multiple_of": multiple, "window_tokens": None}
        for f in dataclasses.fields(cls):
            if f.name in values:
                continue
            column = [getattr(p, f.name) for p in parts]
            if any(v is None for v in column):
                values[f.name] = None
            elif isinstance(column[0], ImageInputs):
                values[f.name] = ImageInputs.concat(column)
            elif isinstance(column[0], SamplerRecord):
                values[f.name] = SamplerRecord.concat(column)
            else:
                values[f.name] = torch.cat(column)
        return cls(**values)
