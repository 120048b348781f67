"""The token loop both fast paths share (the hand-written decoder and the model's own forward): each step's logits
in, one token per row out, with `generate`'s token selection and its stopping rule.

Decisions:

1. Token selection is transformers' own logits processors on the same sequences `generate` passes them, then
   argmax or a categorical draw (`sampling`). Each token's log-prob and entropy under the tempered softmax of the
   raw logits are kept (`SamplerRecord.logps`, `exact`), and on request that softmax itself (`replay`).
5. With processors beyond the temperature (top-k / top-p / min-p, penalties, suppressed tokens), the loop also keeps
   what the sampler knows at draw time (`algorithms.truncation`): the log of the mass the tempered softmax puts on
   the kept support (the finite processed scores), the log-prob of each token under the processed distribution it
   was drawn from (`KeptSupports.drawn_logps`), and on request the kept supports, packed. With `renormalise` (the
   loss's `keep_sampling_mask`) the kept log-probs, entropies and softmax are those of the tempered softmax over
   the kept support, as the loss computes them.
2. Rows stop at their first EOS and are padded after it; the loop stops once every row has. With partial rollouts'
   rule (`PromptBatch.end`, `rollout.types.RoundEnd`) a row also stops after its own budget of new tokens, and the
   loop stops as soon as the rule is met (enough complete groups): the rows still open come back cut there.
3. Logits that are not finite stop the rollout at the step they appear, naming the step and the rows, so that a
   broken model is reported as one, not as a non-finite loss later. The check reads the log-probs already
   computed (a NaN or +inf logit makes its whole row's log-softmax NaN), one reduction per token.
4. Past `max_position_embeddings` the loop warns as `generate` does (the same words, once), at the same step.

Shapes: `B` rows, `S` prompt columns, `T` new tokens, `V` vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from grpo_trainer.algorithms.truncation import pack
from grpo_trainer.rollout.fast.guard import processors
from grpo_trainer.rollout.fast.sampling import sample_from_logits, sample_from_probs
from grpo_trainer.rollout.types import (
    KeptSupports,
    PromptBatch,
    ReplayCapture,
    Rollout,
    SamplerRecord,
    end_at_first_eos,
    special_tokens,
)

__all__ = ["Decoded", "Draw", "NonFiniteLogitsError", "choose", "non_finite_error", "run", "to_rollout",
           "warn_past_limit"]

logger = logging.getLogger(__name__)


class NonFiniteLogitsError(RuntimeError):
    """The model returned NaN or infinite logits during a rollout."""


class Draw(NamedTuple):
    """One step's draw for `B` rows (decisions 1 and 5)."""

    tokens: Tensor  # [B]
    logps: Tensor  # [B] as the loss scores them (over the kept support with `renormalise`)
    entropy: Tensor  # [B] of that distribution
    log_kept_mass: Tensor | None = None  # [B] None: only the temperature processed the logits
    behaviour_logps: Tensor | None = None  # [B] under the processed distribution drawn from
    kept: Tensor | None = None  # [B, V] bool, the kept support


def choose(scores: Tensor, sequences: Tensor, processor_list: LogitsProcessorList, config: GenerationConfig,
           temperature: float, probs_out: Tensor | None = None, renormalise: bool = False,
           u: Tensor | None = None) -> Draw:
    """Next tokens `[B]`, and their log-probs and the entropies `[B]` under the tempered softmax of the raw logits
    `scores` `[B, V]` (also written to `probs_out` when given); over the kept support with `renormalise`
    (decision 5). When the only processor is the temperature (the trainer's default settings), the distribution
    sampled from is that softmax, computed once. `u` `[B, 2]`: the draw's uniforms (`sampling.sample_from_probs`;
    drawn there when None)."""
    log_p = torch.log_softmax(scores if temperature == 1.0 else scores / temperature, dim=-1)  # [B, V]
    if config.do_sample and all(type(p) is TemperatureLogitsWarper for p in processor_list):
        probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
        tokens = sample_from_probs(probs, u=u)
        return Draw(tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, log_p))
    processed = processor_list(sequences, scores)  # [B, V]
    tokens = sample_from_logits(processed, config.do_sample, u)
    if not config.do_sample:  # greedy: no sampling distribution (`capture` drops the sampler's values)
        probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
        return Draw(tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, log_p))
    kept = processed > -torch.inf  # [B, V]
    behaviour = torch.log_softmax(processed, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    mass = torch.logsumexp(log_p.masked_fill(~kept, -torch.inf), dim=-1)  # log p(S): log_p is normalised
    finite = log_p
    if renormalise:
        log_p = (log_p - mass[:, None]).masked_fill_(~kept, -torch.inf)
        finite = log_p.masked_fill(~kept, 0.0)  # 0 log 0 = 0 off the support
    probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
    return Draw(tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, finite), mass,
                behaviour, kept)


class Decoded(NamedTuple):
    """A rollout's tokens and what the loop kept of each, `[B, T']`."""

    completion_ids: Tensor
    logps: Tensor
    entropy: Tensor
    log_kept_mass: Tensor | None = None  # None: only the temperature processed the logits (decision 5)
    behaviour_logps: Tensor | None = None


def run(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, scores: Tensor,
        next_scores: Callable[[Tensor, int], Tensor], sequences: Tensor, max_new: int,
        probs: Tensor | None = None, masks: Tensor | None = None, renormalise: bool = False) -> Decoded:
    """Completion tokens `[B, T']` (T' <= max_new: the loop stops once every row has ended), and their log-probs
    and entropies `[B, T']` (decision 5 for the rest). `scores` `[B, V]`: float32 logits after the prompt;
    `next_scores(tokens, t)`: the logits after feeding token `t` `[B]`; `sequences` `[B, S + max_new]`: the prompt,
    then filled with the tokens (processors and `next_scores` may read it). Fills `probs[:, :T']` (the tempered
    softmax) and `masks[:, :T']` (the packed kept supports, `[B, max_new, ceil(V / 8)]` uint8) when given."""
    eos, pad = special_tokens(config)
    B, S = prompts.ids.shape
    eos_ids = torch.tensor(eos, device=scores.device, dtype=torch.long)
    processor_list = processors(lm, config, prompts.ids, prompts.mask)
    finished = torch.zeros(B, dtype=torch.bool, device=scores.device)
    logps, entropy = torch.zeros(2, B, max_new, device=scores.device)  # [B, T] each
    masses = behaviour = None
    temperature = config.temperature if config.do_sample and config.temperature is not None else 1.0
    limit = getattr(lm.config, "max_position_embeddings", None)
    warn_step = None if limit is None else max(0, limit - S)  # generate warns once S + t + 1 columns > limit
    end = prompts.end
    for t in range(max_new):
        draw = choose(scores, sequences[:, :S + t], processor_list, config, temperature,
                      None if probs is None else probs[:, t], renormalise)
        tokens, logps[:, t], entropy[:, t] = draw.tokens, draw.logps, draw.entropy
        if draw.log_kept_mass is not None:
            if masses is None:
                masses, behaviour = torch.zeros(2, B, max_new, device=scores.device)
            masses[:, t], behaviour[:, t] = draw.log_kept_mass, draw.behaviour_logps
            if masks is not None:
                masks[:, t] = pack(draw.kept)
        if not bool((torch.isfinite(logps[:, t]) | finished).all()):
            _raise_non_finite(logps[:, t], finished, t)
        tokens.masked_fill_(finished, pad)  # [B]
        sequences[:, S + t] = tokens
        finished |= torch.isin(tokens, eos_ids)
        if end is not None:
            finished |= end.budgets <= t + 1
        if t == warn_step and t < max_new - 1:
            warn_past_limit(limit)
        if t == max_new - 1 or bool(finished.all()) or (end is not None and end.reached(finished)):
            break
        scores = next_scores(tokens, t)
    T = t + 1
    return Decoded(sequences[:, S:S + T], logps[:, :T], entropy[:, :T], None if masses is None else masses[:, :T],
                   None if behaviour is None else behaviour[:, :T])


def to_rollout(prompts: PromptBatch, config: GenerationConfig, decoded: Decoded, probs: Tensor | None,
                 masks: Tensor | None, outputs: Tensor | None = None) -> Rollout:
    """The `Rollout` of a `loop.run` (its tensors cloned out of inference mode; the buffers cut to the length
    decoded): tokens after each row's first EOS become padding."""
    completion_ids, logps, entropy = (t.clone() for t in decoded[:3])
    masses, behaviour = (None if t is None else t.clone() for t in decoded[3:])
    S, T = prompts.ids.shape[1], completion_ids.shape[1]  # the used part of the buffers (views made out here)
    outputs = None if outputs is None else outputs[:, :, :S + T]
    probs = None if probs is None else probs[:, :T]
    masks = None if masks is None or masses is None else masks[:, :T]
    completion_ids, mask, truncated = end_at_first_eos(completion_ids, config)
    record = SamplerRecord("decoder", logps=logps, entropy=entropy, exact=True,
                           kept=KeptSupports(masks, masses, behaviour), replay=ReplayCapture(probs, outputs))
    return Rollout(prompts.ids, prompts.mask, completion_ids, mask, truncated, record)


def _raise_non_finite(logps: Tensor, finished: Tensor, step: int) -> None:
    rows = (~torch.isfinite(logps) & ~finished).nonzero().squeeze(1).tolist()
    raise non_finite_error(step, rows, logps.shape[0])


def non_finite_error(step: int, rows: list[int], B: int) -> NonFiniteLogitsError:
    """Decision 3's error: NaN/inf logits at completion token `step` in `rows` of `B`."""
    return NonFiniteLogitsError(
        f"the model produced NaN/inf logits at completion token {step} in {len(rows)} of {B} rows "
        f"(rows {rows[:8]}{', ...' if len(rows) > 8 else ''}); the rollout stopped there. The weights or the "
        "activations are not finite: check the last optimizer steps (learning_rate, max_grad_norm) and the dtype "
        "(float16 overflows where bfloat16 and float32 do not).")


def warn_past_limit(limit: int | None) -> None:
    """Decision 4: `generate`'s warning past `max_position_embeddings`, in its words, once."""
    logger.warning_once(
        "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
        f"maximum length ({limit}). Depending on the model, you may observe exceptions, performance "
        "degradation, or nothing at all.")
