"""The token loop both fast paths share (the hand-written decoder and the model's own forward): each step's logits
in, one token per row out, with `generate`'s token selection and its stopping rule.

Decisions:

1. Token selection is transformers' own logits processors on the same sequences `generate` passes them, then
   argmax or a categorical draw (`sampling`). Each token's log-prob and entropy under the full tempered softmax
   of the raw logits are kept (`Rollout.sampling_logps`), and on request that softmax itself (`replay`).
2. Rows stop at their first EOS and are padded after it; the loop stops once every row has.
3. Logits that are not finite stop the rollout at the step they appear, naming the step and the rows, so that a
   broken model is reported as one, not as a non-finite loss later. The check reads the log-probs already
   computed (a NaN or +inf logit makes its whole row's log-softmax NaN), one reduction per token.
4. Past `max_position_embeddings` the loop warns as `generate` does (the same words, once), at the same step.

Shapes: `B` rows, `S` prompt columns, `T` new tokens, `V` vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from grpo_trainer.rollout.fast.guard import processors
from grpo_trainer.rollout.fast.sampling import sample_from_logits, sample_from_probs
from grpo_trainer.rollout.types import PromptBatch, special_tokens

__all__ = ["NonFiniteLogitsError", "choose", "run"]

logger = logging.getLogger(__name__)


class NonFiniteLogitsError(RuntimeError):
    """The model returned NaN or infinite logits during a rollout."""


def choose(scores: Tensor, sequences: Tensor, processor_list: LogitsProcessorList, config: GenerationConfig,
           temperature: float, probs_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Next tokens `[B]`, and their log-probs and the entropies `[B]` under the full tempered softmax of the raw
    logits `scores` `[B, V]` (also written to `probs_out` when given). When the only processor is the temperature
    (the trainer's default settings), the distribution sampled from is that softmax, computed once."""
    log_p = torch.log_softmax(scores if temperature == 1.0 else scores / temperature, dim=-1)  # [B, V]
    probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
    if config.do_sample and all(type(p) is TemperatureLogitsWarper for p in processor_list):
        tokens = sample_from_probs(probs)
    else:
        tokens = sample_from_logits(processor_list(sequences, scores), config.do_sample)
    return tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, log_p)


def run(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, scores: Tensor,
        next_scores: Callable[[Tensor, int], Tensor], sequences: Tensor, max_new: int,
        probs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Completion tokens `[B, T']` (T' <= max_new: the loop stops once every row has ended), and their log-probs
    and entropies `[B, T']`. `scores` `[B, V]`: float32 logits after the prompt; `next_scores(tokens, t)`: the
    logits after feeding token `t` `[B]`; `sequences` `[B, S + max_new]`: the prompt, then filled with the tokens
    (processors and `next_scores` may read it). Fills `probs[:, :T']` (the tempered softmax) when given."""
    eos, pad = special_tokens(config)
    B, S = prompts.ids.shape
    eos_ids = torch.tensor(eos, device=scores.device, dtype=torch.long)
    processor_list = processors(lm, config, prompts.ids, prompts.mask)
    finished = torch.zeros(B, dtype=torch.bool, device=scores.device)
    logps, entropy = torch.zeros(2, B, max_new, device=scores.device)  # [B, T] each
    temperature = config.temperature if config.do_sample and config.temperature is not None else 1.0
    limit = getattr(lm.config, "max_position_embeddings", None)
    warn_step = None if limit is None else max(0, limit - S)  # generate warns once S + t + 1 columns > limit
    for t in range(max_new):
        tokens, logps[:, t], entropy[:, t] = choose(scores, sequences[:, :S + t], processor_list, config,
                                                    temperature, None if probs is None else probs[:, t])
        if not bool((torch.isfinite(logps[:, t]) | finished).all()):
            _raise_non_finite(logps[:, t], finished, t)
        tokens.masked_fill_(finished, pad)  # [B]
        sequences[:, S + t] = tokens
        finished |= torch.isin(tokens, eos_ids)
        if t == warn_step and t < max_new - 1:
            logger.warning_once(
                "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
                f"maximum length ({limit}). Depending on the model, you may observe exceptions, performance "
                "degradation, or nothing at all.")
        if t == max_new - 1 or bool(finished.all()):
            break
        scores = next_scores(tokens, t)
    return sequences[:, S:S + t + 1], logps[:, :t + 1], entropy[:, :t + 1]


def _raise_non_finite(logps: Tensor, finished: Tensor, step: int) -> None:
    rows = (~torch.isfinite(logps) & ~finished).nonzero().squeeze(1).tolist()
    raise NonFiniteLogitsError(
        f"the model produced NaN/inf logits at completion token {step} in {len(rows)} of {logps.shape[0]} rows "
        f"(rows {rows[:8]}{', ...' if len(rows) > 8 else ''}); the rollout stopped there. The weights or the "
        "activations are not finite: check the last optimizer steps (learning_rate, max_grad_norm) and the dtype "
        "(float16 overflows where bfloat16 and float32 do not).")
