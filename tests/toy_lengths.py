"""Completion lengths as real runs have them, for random-weight models that never sample EOS on their own.

A random model's completions all run to `max_completion_length`, so a benchmark or test built on one never meets
padding. `install_lengths(model, LogNormalLengths(...))` makes the model's own generation end each completion at a
drawn length: a logits processor appended to the ones transformers builds (`model._get_logits_processor`), which
both `model.generate` (TRL's rollout) and this package's fast and forward rollouts call, forbids EOS before the
drawn step and forces it there. The length of a row depends only on its prompt's tokens, which copy of that prompt
it is within the call, and the seed, so two trainers given the same prompts get the same lengths, whatever their
batching (`KeyedLengths` keys it otherwise, so that a resumed partial row keeps its length). A drawn length of
`max_completion_length` means no EOS: the completion is cut there, as a truncated one.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor

from grpo_trainer.modeling.unwrap import causal_lm

__all__ = ["ForcedLengths", "KeyedLengths", "LogNormalLengths", "install_lengths"]


@dataclass(frozen=True)
class LogNormalLengths:
    """Completion lengths log-normal around `median` (log-space standard deviation `sigma`), rounded and clipped to
    [`minimum`, `maximum`]."""

    maximum: int
    median: float
    sigma: float
    minimum: int = 16
    seed: int = 0

    def length(self, prompt: tuple[int, ...], copy: int) -> int:
        key = zlib.crc32(repr((self.seed, prompt, copy)).encode())
        draw = math.exp(random.Random(key).gauss(math.log(self.median), self.sigma))
        return max(min(self.minimum, self.maximum), min(self.maximum, round(draw)))

    def lengths(self, prompt_ids: Tensor, pad_token_id: int | None) -> list[int]:
        """One length per row of `prompt_ids` `[B, S]` (left padding with `pad_token_id` ignored)."""
        seen: dict[tuple[int, ...], int] = {}
        out = []
        for row in prompt_ids.tolist():
            first = next((i for i, t in enumerate(row) if t != pad_token_id), len(row))
            prompt = tuple(row[first:])
            copy = seen[prompt] = seen.get(prompt, -1) + 1
            out.append(self.length(prompt, copy))
        return out


class ForcedLengths(LogitsProcessor):
    """Row i's completion ends with EOS at token `lengths[i]` (1-based): every EOS id gets -inf before that step,
    and at it every token but the first EOS id. Rows longer than the generation's budget are cut by it."""

    def __init__(self, lengths: list[int], prompt_length: int, eos_ids: list[int]) -> None:
        self.lengths, self.prompt_length, self.eos_ids = torch.tensor(lengths), prompt_length, eos_ids

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        step = input_ids.shape[1] - self.prompt_length  # 0-based index of the token being chosen
        lengths = self.lengths.to(scores.device)
        scores = scores.clone()
        before = (step < lengths - 1)[:, None]  # [B, 1]
        at = (step == lengths - 1)[:, None]
        eos = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        eos[self.eos_ids] = True
        chosen = torch.zeros_like(eos)
        chosen[self.eos_ids[0]] = True
        scores.masked_fill_(before & eos, -math.inf)
        scores.masked_fill_(at & ~chosen, -math.inf)
        scores.masked_fill_(at & chosen, 0.0)
        return scores


class KeyedLengths(LogitsProcessor):
    """For partial rollouts, whose resumed rows come back with their tokens so far inside the "prompt": a row's
    length is keyed on its first `prompt_tokens` real tokens (the dataset prompt: every prompt of such a run has that
    many) and its first completion token (which copy it is, as far as the draw goes), and the tokens it already has
    are counted from its sequence, so the row ends at the same drawn length however many rounds decode it. Before its
    first token, EOS is forbidden (the draw's `minimum` is at least 1)."""

    def __init__(self, schedule: LogNormalLengths, prompt_tokens: int, pad_token_id: int | None,
                 eos_ids: list[int]) -> None:
        self.schedule, self.prompt_tokens, self.pad, self.eos_ids = schedule, prompt_tokens, pad_token_id, eos_ids

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            first = next((i for i, t in enumerate(ids) if t != self.pad), len(ids))
            real = ids[first:]
            done = len(real) - self.prompt_tokens  # completion tokens so far
            length = self.schedule.length(tuple(real[:self.prompt_tokens]), real[self.prompt_tokens]) if done > 0 \
                else self.schedule.maximum + 1
            if done < length - 1:
                scores[row, self.eos_ids] = -math.inf
            elif done == length - 1:
                scores[row] = -math.inf
                scores[row, self.eos_ids[0]] = 0.0
        return scores


def install_lengths(model: nn.Module, schedule: LogNormalLengths, pad_token_id: int | None = None,
                    prompt_tokens: int | None = None) -> None:
    """Every generation of `model` (the causal LM behind any wrapper) from now on ends its completions at
    `schedule`'s lengths, with the EOS of the generation's own config (the model's where it has none). The pad id
    (prompts' left padding) is the model's generation config's unless given. `prompt_tokens`: key each row's length
    on its first that many tokens and its first completion token (`KeyedLengths`, for partial rollouts) instead of
    its whole prompt and copy."""
    lm = causal_lm(model)
    original = lm._get_logits_processor
    pad = lm.generation_config.pad_token_id if pad_token_id is None else pad_token_id

    def with_lengths(*args, **kwargs):
        processors = original(*args, **kwargs)
        config = kwargs.get("generation_config", args[0] if args else None)
        prompt_ids = kwargs.get("encoder_input_ids", args[2] if len(args) > 2 else None)
        eos = getattr(config, "eos_token_id", None)
        eos = lm.generation_config.eos_token_id if eos is None else eos
        eos_ids = [eos] if isinstance(eos, int) else list(eos)
        if prompt_tokens is not None:
            processors.append(KeyedLengths(schedule, prompt_tokens, pad, eos_ids))
        else:
            processors.append(ForcedLengths(schedule.lengths(prompt_ids, pad), prompt_ids.shape[1], eos_ids))
        return processors

    lm._get_logits_processor = with_lengths
