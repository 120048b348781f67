"""The speculative token loop over the fast decoder: each forward feeds every live row's last token and its draft,
and commits what `verify` holds.

Decisions:

1. Uniforms for every (row, token index) are drawn once, before the first forward (`[B, T, 2]` float64, the two
   of `fast.sampling`'s draw): a token's draw reads its own, however many forwards the row took to reach it, so
   drafts change the forward count and never the tokens (`verify`). The plain loop's random stream is not this one:
   with speculation on, a seed samples other completions than with it off, from the same distribution.
2. Rows advance by different counts, so each row's keys and values sit at its own columns (`Decoder.verify`):
   token i of a completion at cache column S + i, as in the plain loop. A rejected position's column is stale until
   the row's next forward overwrites it (it starts there); the mask never lets a query read a column past its own.
   The cache is `max_draft_tokens` columns longer than the plain loop's, for the last forward's draft positions.
3. Everything kept of a committed token (its log-prob and entropy, kept support, truncated-sampling values, the
   softmax for replay, every layer's output) comes from the forward whose logits drew it: `fast.loop.choose` on all
   N x Q positions of the forward, then the committed ones scattered to their (row, token index).
4. Logits processors see what the plain loop hands them: a position that draws token index t of row b is
   processed with that row's sequence as the plain loop has it at step t (its prompt columns, its tokens before t,
   drafted ones included), so the positions of one forward are processed in groups of one t (`_ByLength`). Those
   that read the scores alone (`ROW_INDEPENDENT`: temperature, top-k/p/h, min-p, typical, epsilon, eta, suppressed
   tokens) take every position in one call. Served: those, and the processors that read only their own row's
   sequence (`ROW_WISE`: repetition penalty, n-gram bans, sequence biases and bad words, minimum lengths, forced
   BOS/EOS, suppression at the first token). Any other processor (one indexed by batch row, like the encoder
   repetition penalty, or one with state of its own, like a watermark) is refused (`blocker`): the backend then
   decodes without drafts and logs why.
5. The plain loop's rules hold at the same positions: a row ends at its first EOS (a drafted EOS that is drawn ends
   it there), at `max_new` tokens (drafts are cut to what the row may still commit), and logits that are not finite
   at a committed position stop the rollout naming that token.

Shapes: `B` rows, `N` live rows in a forward, `Q` positions each, `S` prompt columns, `T` new tokens, `V`
vocabulary, `E` hidden size.
"""

from __future__ import annotations

import copy
import logging
import time

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from grpo_trainer.algorithms.truncation import pack
from grpo_trainer.rollout.fast.decoder import Decoder
from grpo_trainer.rollout.fast.loop import Decoded, choose, non_finite_error, warn_past_limit
from grpo_trainer.rollout.speculative.drafts import Drafter
from grpo_trainer.rollout.speculative.policy import DraftPolicy, ForwardCost, width
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
from grpo_trainer.rollout.speculative.verify import committed_counts
from grpo_trainer.rollout.types import DecodeCounts, PromptBatch, special_tokens

__all__ = ["ROW_INDEPENDENT", "ROW_WISE", "blocker", "run"]

logger = logging.getLogger(__name__)

ROW_INDEPENDENT = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TopHLogitsWarper, MinPLogitsWarper,
                   TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, SuppressTokensLogitsProcessor,
                   InfNanRemoveLogitsProcessor)
ROW_WISE = (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor,
            MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, ForcedBOSTokenLogitsProcessor,
            ForcedEOSTokenLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, NoBadWordsLogitsProcessor)


def blocker(processor_list: LogitsProcessorList) -> str | None:
    """Why drafts cannot be verified under these processors (decision 4), or None."""
    for processor in processor_list:
        if type(processor) not in ROW_INDEPENDENT + ROW_WISE:  # a subclass may read more
            return (f"the logits processor {type(processor).__name__} is not known to read only its own row's "
                    "sequence, which the positions of one verifying forward hold at different lengths")
    return None


class _ByLength:
    """The processors of a forward's positions, each group of one token index with the plain loop's sequences
    (decision 4). `sequences` `[M, W]`: each position's row (prompt, tokens, drafts); `steps` `[M]`: the token index
    it draws; `rows` `[M]`: its batch row; `S` prompt columns."""

    def __init__(self, processor_list: LogitsProcessorList, sequences: Tensor, steps: Tensor, rows: Tensor,
                 S: int) -> None:
        self.processor_list, self.sequences, self.steps, self.rows, self.S = processor_list, sequences, steps, rows, S
        self.row_wise = any(type(p) in ROW_WISE for p in processor_list)

    def __iter__(self):
        return iter(self.processor_list)

    def __call__(self, _: Tensor, scores: Tensor) -> Tensor:
        if not self.row_wise:  # processors of the scores alone (`ROW_INDEPENDENT`) read no sequence
            return self.processor_list(self.sequences[:1, :1].expand(scores.shape[0], 1), scores)
        out = torch.empty_like(scores)
        for t in self.steps.unique().tolist():
            at = (self.steps == t).nonzero().squeeze(1)
            group = LogitsProcessorList(_of_rows(p, self.rows[at]) for p in self.processor_list)
            out[at] = group(self.sequences[at, :self.S + t], scores[at])
        return out


class _Sequences:
    """Every row's prompt columns, committed tokens and, for one forward, its draft (decision 4), `[B, S + T +
    draft]`: kept only where a processor reads them (`ROW_WISE`)."""

    def __init__(self, processor_list: LogitsProcessorList, prompts: PromptBatch, width: int, pad: int) -> None:
        self.processor_list, self.S = processor_list, prompts.ids.shape[1]
        self.row_wise = any(type(p) in ROW_WISE for p in processor_list)
        B = prompts.ids.shape[0]
        self.tokens = torch.cat([prompts.ids, prompts.ids.new_full((B, width), pad)], 1) if self.row_wise \
            else prompts.ids[:, :1]

    def commit(self, row: int, start: int, tokens: list[int]) -> None:
        """Row `row`'s tokens `start`, `start + 1`, ... committed."""
        if self.row_wise:
            self.tokens[row, self.S + start:self.S + start + len(tokens)] = torch.tensor(tokens,
                                                                                       device=self.tokens.device)

    def processors(self, rows: Tensor, steps: Tensor, columns: Tensor | None = None,
                   drafts: Tensor | None = None) -> _ByLength:
        """The processors of positions drawing token indices `steps` `[N, Q]` of `rows` `[N]`, whose drafts
        `drafts` `[N, Q - 1]` sit at cache columns `columns[:, 1:]`."""
        N, Q = steps.shape
        if not self.row_wise:  # the processors read the scores alone
            return _ByLength(self.processor_list, self.tokens, steps.reshape(-1), rows, self.S)
        drafted = self.tokens[rows]  # [N, S + T + draft]: each row's committed tokens, then its draft
        if Q > 1:
            drafted.scatter_(1, columns[:, 1:], drafts)
        return _ByLength(self.processor_list, drafted.repeat_interleave(Q, 0), steps.reshape(-1),
                         rows.repeat_interleave(Q), self.S)


def _of_rows(processor, rows: Tensor):
    """`processor` for the batch rows `rows`: the repetition penalty keeps each row's prompt padding (a `[B]`
    tensor, to leave it out of the penalised tokens); the other served processors hold no per-row state."""
    ignored = getattr(processor, "prompt_ignore_length", None)
    if type(processor) is RepetitionPenaltyLogitsProcessor and isinstance(ignored, Tensor):
        processor = copy.copy(processor)
        processor.prompt_ignore_length = ignored.to(rows.device)[rows]
    return processor


class _Kept:
    """The per-token buffers of a round (`fast.loop.Decoded`'s fields and the capture buffers), filled at the
    committed (row, token index) pairs (decision 3)."""

    def __init__(self, B: int, max_new: int, pad: int, device: torch.device, probs: Tensor | None,
                 masks: Tensor | None) -> None:
        self.tokens = torch.full((B, max_new), pad, dtype=torch.long, device=device)
        self.logps, self.entropy = torch.zeros(2, B, max_new, device=device)
        self.masses = self.behaviour = None
        self.probs, self.masks = probs, masks

    def write(self, rows: Tensor, steps: Tensor, at: Tensor, draw, probs: Tensor | None) -> None:
        """Positions `at` (`[N * Q]` bool) of a forward's draws, rows `rows` and token indices `steps` `[N * Q]`."""
        r, t = rows[at], steps[at]
        self.tokens[r, t] = draw.tokens[at]
        self.logps[r, t], self.entropy[r, t] = draw.logps[at], draw.entropy[at]
        if draw.log_kept_mass is not None:
            if self.masses is None:
                self.masses, self.behaviour = torch.zeros_like(self.logps), torch.zeros_like(self.logps)
            self.masses[r, t], self.behaviour[r, t] = draw.log_kept_mass[at], draw.behaviour_logps[at]
            if self.masks is not None:
                self.masks[r, t] = pack(draw.kept[at])
        if self.probs is not None:
            self.probs[r, t] = probs[at].to(self.probs.dtype)

    def decoded(self, T: int) -> Decoded:
        cut = (lambda x: None if x is None else x[:, :T])
        return Decoded(self.tokens[:, :T], self.logps[:, :T], self.entropy[:, :T], cut(self.masses),
                       cut(self.behaviour))


def run(lm: nn.Module, decoder: Decoder, config: GenerationConfig, prompts: PromptBatch, scores: Tensor,
        processor_list: LogitsProcessorList, max_new: int, settings: SpeculativeSettings, drafter: Drafter,
        cost: ForwardCost | None = None, probs: Tensor | None = None, masks: Tensor | None = None,
        renormalise: bool = False) -> tuple[Decoded, DecodeCounts]:
    """Completion tokens `[B, T']` and what the plain loop (`fast.loop.run`) keeps of them, decoded with drafts, and
    what the decoding cost. `decoder`: prefilled, its cache at least `S + max_new + max_draft_tokens` columns;
    `scores` `[B, V]`: float32 logits after the prompt; `cost`: the forwards' timings, for policy "measured"
    (`policy.width`; None: policy "fixed"). Fills `probs[:, :T']` and `masks[:, :T']` when given."""
    eos, pad = special_tokens(config)
    B, S = prompts.ids.shape
    device = scores.device
    eos_ids = torch.tensor(eos, device=device, dtype=torch.long)
    temperature = config.temperature if config.do_sample and config.temperature is not None else 1.0
    u = torch.rand((B, max_new, 2), dtype=torch.float64, device=device) if config.do_sample else None  # decision 1
    kept = _Kept(B, max_new, pad, device, probs, masks)
    sequences = _Sequences(processor_list, prompts, max_new + settings.max_draft_tokens, pad)
    real = prompts.mask.long().sum(1)  # [B] each row's first completion position
    allowed_prompt = prompts.mask.bool()  # [B, S]
    limit = getattr(lm.config, "max_position_embeddings", None)
    warn_step = None if limit is None else max(0, limit - S)
    policy = DraftPolicy(settings, B)
    counts = dict(forwards=0, row_forwards=0, positions=0, generated=0, drafted=0, accepted=0)

    # Token 0 of every row, from the prefill's logits.
    everyone = torch.arange(B, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    draw = _draw(scores, sequences.processors(everyone, zeros[:, None]), config, temperature, renormalise, probs,
                 None if u is None else u[:, 0])
    _check_finite(draw.logps, everyone, zeros, B)
    kept.write(everyone, zeros, torch.ones(B, dtype=torch.bool, device=device), draw, draw.probs)
    first = draw.tokens.tolist()
    committed = [1] * B  # tokens committed per row
    finished = [token in eos or max_new == 1 for token in first]
    for row, token in enumerate(first):
        drafter.commit(row, [token])
        sequences.commit(row, 0, [token])
    _warn_past_limit(warn_step, 0, max_new, limit)

    while not all(finished):
        live = [r for r in range(B) if not finished[r]]
        N = len(live)
        limits = policy.limits(live, [max_new - committed[r] - 1 for r in live])
        drafts = [drafter.draft(r, k) for r, k in zip(live, limits)]
        if cost is not None:  # policy "measured": as wide as pays
            Q = width([len(d) for d in drafts], policy.acceptance(live), cost)
            drafts = [d[:Q - 1] for d in drafts]
        Q = 1 + max(len(d) for d in drafts)
        started = time.perf_counter()
        rows = torch.tensor(live, device=device)
        n = torch.tensor([committed[r] for r in live], device=device)  # [N]
        ids, lengths = _fed(kept.tokens[rows, n - 1], drafts, Q, pad)
        offsets = torch.arange(Q, device=device)
        steps = n[:, None] - 1 + offsets  # [N, Q] the token index each position feeds
        columns = S + steps
        cos, sin = decoder.rotation_tables(real[rows, None] + steps)
        mask = _mask(columns, allowed_prompt[rows], decoder.embed.dtype)
        fed = offsets[None, :] <= lengths[:, None]  # [N, Q] real positions (the rest pad a shorter draft)
        hidden = decoder.verify(rows, ids, columns, cos, sin, mask, kept=fed)  # [N, Q, E]
        logits = decoder.logits(hidden.view(N * Q, -1))  # [N * Q, V]

        drawn_steps = (steps + 1).clamp_(max=max_new - 1)  # [N, Q] the token index each position draws
        uniforms = None if u is None else u[rows[:, None], drawn_steps].view(N * Q, 2)
        draw = _draw(logits, sequences.processors(rows, drawn_steps, columns, ids[:, 1:]), config, temperature,
                     renormalise, probs, uniforms)
        m = committed_counts(draw.tokens.view(N, Q), ids[:, 1:], lengths, eos_ids)  # [N]
        at = (offsets[None, :] < m[:, None]).view(-1)
        flat_rows, flat_steps = rows[:, None].expand(N, Q).reshape(-1), drawn_steps.reshape(-1)
        _check_finite(draw.logps[at], flat_rows[at], flat_steps[at], B)
        kept.write(flat_rows, flat_steps, at, draw, draw.probs)

        tokens = draw.tokens.view(N, Q).tolist()  # (on an accelerator, waits for the forward and the draws)
        if cost is not None:
            cost.observe(N * Q, time.perf_counter() - started)
        accepted = [c - 1 for c in m.tolist()]
        for i, row in enumerate(live):
            new = tokens[i][:accepted[i] + 1]
            sequences.commit(row, committed[row], new)
            drafter.commit(row, new)
            committed[row] += len(new)
            finished[row] = new[-1] in eos or committed[row] >= max_new
        policy.update(live, [len(d) for d in drafts], [min(a, len(d)) for a, d in zip(accepted, drafts)])
        counts["forwards"] += 1
        counts["row_forwards"] += N
        counts["positions"] += N * Q
        counts["drafted"] += int(lengths.sum())
        counts["accepted"] += sum(min(a, len(d)) for a, d in zip(accepted, drafts))
        if warn_step is not None:
            _warn_past_limit(warn_step, max(committed) - 1, max_new, limit)

    T = max(committed)
    counts["generated"] = sum(committed)
    completions = kept.tokens[:, :T].tolist()
    drafter.remember([c[:n] for c, n in zip(completions, committed)])
    return kept.decoded(T), DecodeCounts(**counts)


def _fed(last: Tensor, drafts: list[list[int]], Q: int, pad: int) -> tuple[Tensor, Tensor]:
    """A forward's input ids `[N, Q]`, each row's last committed token `last` `[N]` then its draft (padded), and the
    draft lengths `[N]`."""
    N = last.shape[0]
    ids = torch.full((N, Q), pad, dtype=torch.long, device=last.device)
    ids[:, 0] = last
    if Q > 1:
        ids[:, 1:] = torch.tensor([d + [pad] * (Q - 1 - len(d)) for d in drafts], device=last.device)
    return ids, torch.tensor([len(d) for d in drafts], device=last.device)


def _mask(columns: Tensor, prompt: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive attention mask `[N, 1, Q, W]` of queries at cache `columns` `[N, Q]` (decision 2): the row's
    real prompt columns (`prompt` `[N, S]`) and its completion columns up to the query's own."""
    N, Q = columns.shape
    S = prompt.shape[1]
    reach = torch.arange(int(columns[:, -1].max()) + 1, device=columns.device)  # [W]: up to the last query
    may_read = (reach[None, None, :] <= columns[:, :, None]) & (reach >= S)[None, None, :]
    may_read[:, :, :S] = prompt[:, None, :]
    mask = torch.zeros(N, 1, Q, reach.shape[0], dtype=dtype, device=columns.device)
    mask[:, 0].masked_fill_(~may_read, float("-inf"))
    return mask


class _Draw:
    """`fast.loop.Draw` over N x Q positions, with the softmax for replay when asked (decision 3)."""

    def __init__(self, draw, probs: Tensor | None) -> None:
        self.tokens, self.logps, self.entropy = draw.tokens, draw.logps, draw.entropy
        self.log_kept_mass, self.behaviour_logps, self.kept = draw.log_kept_mass, draw.behaviour_logps, draw.kept
        self.probs = probs


def _draw(scores: Tensor, by_length: _ByLength, config: GenerationConfig, temperature: float, renormalise: bool,
          probs_buffer: Tensor | None, u: Tensor | None) -> _Draw:
    """`fast.loop.choose` on `scores` `[M, V]` with uniforms `u` `[M, 2]`, each position's processors given its own
    sequence (decision 4)."""
    out = None if probs_buffer is None else scores.new_empty(scores.shape)
    return _Draw(choose(scores, by_length.sequences, by_length, config, temperature, out, renormalise, u), out)


def _check_finite(logps: Tensor, rows: Tensor, steps: Tensor, B: int) -> None:
    """Decision 5: the plain loop's error, at the first committed token index whose log-prob is not finite."""
    bad = ~torch.isfinite(logps)
    if bool(bad.any()):
        step = int(steps[bad].min())
        raise non_finite_error(step, rows[bad & (steps == step)].tolist(), B)


def _warn_past_limit(warn_step: int | None, step: int, max_new: int, limit: int | None) -> None:
    if warn_step is not None and step >= warn_step and warn_step < max_new - 1:
        warn_past_limit(limit)
