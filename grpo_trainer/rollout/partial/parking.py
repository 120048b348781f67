"""Which groups a partial round starts, decodes, trains and parks, and the state it carries to the next round.

Decisions:

1. A round of `P` prompts (this process's: its rows are whole groups of `G`) starts, in order: the parked groups,
   oldest first; its own `P` prompts; and `extra_prompts` more from a seeded stream of the training set, so that
   about (1 + alpha) x P groups start. Every prompt the dataloader gives is started in the round it is given (none
   waits in a queue), and once alpha x P groups are parked the stream is no longer drawn from.
2. Every row not yet ended is decoded: a fresh one from its prompt, a parked one from its prompt and its tokens so
   far (re-prefilled under the new weights: its tokens are unchanged, its continuation is the new policy's), each
   within its share of `max_completion_length`. The rollout ends once `P` groups are complete (every row ended:
   EOS, or the length cap), the `required` ones among them (`rollout.types.RoundEnd`).
3. A group parked `max_parks` times is required (the first `P` of them, oldest first): its next round does not end
   before it completes, so no group is parked forever and none is dropped for being long.
4. The round trains `P` complete groups, the required first, then the others oldest first (`trained_groups`); every
   other group is parked with its rows' tokens, their sampling log-probs and, per token, the optimizer step of the
   weights that sampled it (`SamplerRecord.versions`). A trained round's rows are whole groups, so no completion is
   kept for being short: the advantages see every length the policy produced.
5. The state (parked groups and the stream's position) is this process's, saved in its checkpoint file; the stream
   is seeded per process, so processes draw apart.

Shapes: `P` prompts trained per round, `G` completions per group, `Q` groups started, `B` rows decoded or trained,
`S` prompt tokens, `T` completion tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_trainer.data.sampler import PromptDraws
from grpo_trainer.rollout.partial.settings import PartialSettings
from grpo_trainer.rollout.types import PromptBatch, Rollout, RoundEnd, SamplerRecord

__all__ = ["Group", "PartialRollouts", "PartialRound", "RowSoFar", "extra_prompts", "required_groups",
           "trained_groups"]

_PROCESS_SEED_STRIDE = 7919  # a prime apart from PromptDraws' own stride: each process's stream is its own


@dataclass
class RowSoFar:
    """One completion of a group, as far as it has been sampled."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # the sampler's log-prob of each token
    versions: list[int] = field(default_factory=list)  # the optimizer step of the weights that sampled each token
    ended: bool = False  # EOS, or `max_completion_length` reached: nothing more to decode
    eos: bool = False  # ended by EOS (else truncated)


@dataclass
class Group:
    """A prompt's G completions across rounds."""

    row: dict  # the dataset row they answer
    prompt: list[int]  # its prompt's token ids, tokenised when the group started
    rows: list[RowSoFar]
    parks: int = 0  # rounds it was parked

    @property
    def complete(self) -> bool:
        return all(r.ended for r in self.rows)


@dataclass
class PartialRound:
    """A partial round's trained half: its dataset rows `[B]` (whole groups), their assembled rollout, and what the
    round decoded and parked."""

    rows: list[dict]
    rollout: Rollout
    metrics: dict[str, float]


def extra_prompts(parked: int, prompts: int, alpha: float) -> int:
    """Prompts a round draws from the stream beside its own `prompts` and `parked` groups (decision 1)."""
    return max(0, math.ceil(alpha * prompts) - parked)


def required_groups(parks: Sequence[int], max_parks: int, needed: int) -> list[bool]:
    """Decision 3: `[Q]` whether each started group (in start order) must complete before the round ends."""
    flags, left = [], needed
    for count in parks:
        flags.append(count >= max_parks and left > 0)
        left -= flags[-1]
    return flags


def trained_groups(complete: Sequence[bool], required: Sequence[bool], needed: int) -> list[int]:
    """Decision 4: the `needed` groups a round trains, in start order: every required one (all complete once the
    round ended), then the other complete ones, oldest first."""
    first = [q for q, (done, must) in enumerate(zip(complete, required)) if done and must]
    rest = [q for q, (done, must) in enumerate(zip(complete, required)) if done and not must]
    chosen = (first + rest)[:needed]
    if len(chosen) < needed:
        raise RuntimeError(f"partial rollouts: the round ended with {len(chosen)} complete groups of the {needed} it "
                           "trains; the rollout backend ended it before its RoundEnd was reached.")
    return sorted(chosen)


def _left_padded(sequences: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    width = max(1, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), 1
    return ids, mask


class PartialRollouts:
    """Decisions 1-5 for one process of one run. `tokenize(rows)`: each dataset row's prompt token ids (the prompt
    as the backend sees it, truncated as `max_prompt_length` says)."""

    def __init__(self, settings: PartialSettings, dataset: Any, num_generations: int, max_completion_length: int,
                 seed: int, process_index: int = 0) -> None:
        self.settings, self.dataset, self.G = settings, dataset, num_generations
        self.max_completion_length = max_completion_length
        self.draws = PromptDraws(len(dataset), seed * _PROCESS_SEED_STRIDE + process_index)
        self.parked: list[Group] = []

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self.draws.state_dict(), "parked": [dataclasses.asdict(g) for g in self.parked]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws.load_state_dict(state["draws"])
        self.parked = [Group(g["row"], list(g["prompt"]), [RowSoFar(**r) for r in g["rows"]], g["parks"])
                       for g in state["parked"]]

    # ------------------------------------------------------------------------------------------------ a round

    def round(self, batch: list[dict], version: int, tokenize: Callable[[list[dict]], list[list[int]]],
              generate: Callable[[PromptBatch], Rollout], pad: int, eos: Sequence[int]) -> PartialRound:
        """This process's trained rows and rollout for the round whose dataset rows are `batch` (each prompt G times
        in a row), sampling with the weights of optimizer step `version` through `generate`."""
        G = self.G
        if len(batch) % G:
            raise ValueError(f"partial_rollouts parks whole groups, so each process's rows must be whole groups of "
                             f"num_generations={G}, but this process got {len(batch)} rows; make "
                             "generation_batch_size / num_processes a multiple of num_generations.")
        P = len(batch) // G
        extra = extra_prompts(len(self.parked), P, self.settings.alpha)
        fresh = [batch[p * G] for p in range(P)] + [self.dataset[i] for i in self.draws.draw(extra)]
        groups = self.parked + [Group(row, prompt, [RowSoFar() for _ in range(G)])
                                for row, prompt in zip(fresh, tokenize(fresh))]
        resumed = [r for g in self.parked for r in g.rows if not r.ended]
        reprefilled = sum(len(r.tokens) for r in resumed)  # tokens so far, prefilled again with the prompt
        required = required_groups([g.parks for g in groups], self.settings.max_parks, P)
        decoded, steps = self._decode(groups, required, P, version, generate, pad, eos)
        chosen = trained_groups([g.complete for g in groups], required, P)
        kept = set(chosen)
        self.parked = [dataclasses.replace(g, parks=g.parks + 1) for q, g in enumerate(groups) if q not in kept]
        trained = [groups[q] for q in chosen]
        out = self._assembled(trained, version, pad)
        trained_tokens = int(out.completion_mask.sum())
        metrics = {"partial/parked_groups": float(len(self.parked)), "partial/resumed_rows": float(len(resumed)),
                   "partial/reprefilled_tokens": float(reprefilled),
                   "partial/extra_prompts": float(extra), "partial/decoded_tokens": float(decoded),
                   "partial/trained_tokens": float(trained_tokens), "partial/decode_steps": float(steps)}
        return PartialRound([g.row for g in trained for _ in range(G)], out, metrics)

    def _decode(self, groups: list[Group], required: list[bool], needed: int, version: int,
                generate: Callable[[PromptBatch], Rollout], pad: int, eos: Sequence[int]) -> tuple[int, int]:
        """Decision 2: every open row decoded until the round's end; the rows updated in place. Tokens decoded and
        decode steps run."""
        open_rows = [(q, j) for q, g in enumerate(groups) for j, r in enumerate(g.rows) if not r.ended]
        if not open_rows:
            return 0, 0
        ids, mask = _left_padded([groups[q].prompt + groups[q].rows[j].tokens for q, j in open_rows], pad)
        budgets = torch.tensor([self.max_completion_length - len(groups[q].rows[j].tokens) for q, j in open_rows])
        end = RoundEnd(torch.tensor([q for q, _ in open_rows]), needed, torch.tensor(required), budgets)
        out = generate(PromptBatch(ids, mask, end=end))
        if out.sampler.logps is None:
            raise RuntimeError("partial_rollouts needs the sampler's log-prob of every token it parks, and this "
                               "rollout kept none (greedy decoding, or a temperature other than the loss's).")
        lengths = torch.minimum(out.completion_mask.sum(1).cpu(), budgets)  # a budget's end is no EOS
        tokens, logps = out.completion_ids.cpu().tolist(), out.sampler.logps.float().cpu().tolist()
        for i, (q, j) in enumerate(open_rows):
            row, n = groups[q].rows[j], int(lengths[i])
            row.tokens, row.logps = row.tokens + tokens[i][:n], row.logps + logps[i][:n]
            row.versions = row.versions + [version] * n
            row.eos = n > 0 and tokens[i][n - 1] in eos
            row.ended = row.eos or len(row.tokens) >= self.max_completion_length
        return int(lengths.sum()), out.completion_ids.shape[1]

    def _assembled(self, groups: list[Group], version: int, pad: int) -> Rollout:
        """Decision 4: the trained groups' rows as one rollout `[B, S]` / `[B, T]`, with the sampler's log-probs and
        each token's version."""
        rows = [r for g in groups for r in g.rows]
        prompt_ids, prompt_mask = _left_padded([g.prompt for g in groups for _ in g.rows], pad)
        T = max(1, max(len(r.tokens) for r in rows))
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        logps = torch.zeros((len(rows), T), dtype=torch.float32)
        versions = torch.full((len(rows), T), version, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            if n:
                ids[i, :n], mask[i, :n] = torch.tensor(r.tokens), 1
                logps[i, :n], versions[i, :n] = torch.tensor(r.logps), torch.tensor(r.versions)
        truncated = torch.tensor([not r.eos for r in rows])
        oldest = min((v for r in rows for v in r.versions), default=version)
        record = SamplerRecord("decoder", version=oldest, logps=logps, versions=versions)
        return Rollout(prompt_ids, prompt_mask, ids, mask.int(), truncated, record)
