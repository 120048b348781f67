"""Dynamic sampling (`zero_variance_groups='resample'`, DAPO arXiv:2503.14476 section 3.2): a round whose groups have
equal rewards (no signal, `algorithms.zero_variance`) gets extra prompts, generated and scored, whose informative
groups take those groups' places, until every place holds an informative group or `max_resample_rounds` extra
rounds have run.

Decisions:

1. A round is a row of places, one per group, laid out as the sampler lays out any round: group p is global rows
   [pG, (p+1)G), and process i holds global rows [iR, (i+1)R). A place is filled by a group whose rows lie on the
   same processes in the same numbers (its `pattern`), so each process only swaps its own rows for rows it
   generated itself: no completion, log-prob or replay tensor crosses processes, only the rewards (already
   gathered for the advantages). Places fill in order, each with the first unused matching informative group.
2. Extra prompts come from a seeded stream of the training set (`data.sampler.PromptDraws`), the same on every
   process and saved in checkpoints, so a resumed run draws the same prompts. Every process generates the same
   number of rows in every extra round and makes the same collective calls (every decision is taken from gathered
   rewards), so a process whose groups were all informative still takes part: nothing waits forever.
3. How many: when each process holds whole groups (R a multiple of G), an extra round draws k prompts per process,
   k = ceil(the largest number of empty places on one process / the informative share of the groups seen so far),
   at least 1 and at most the process's own number of groups; a round with no informative group yet draws a full
   round's worth. When groups span processes, an extra round is a full round (the same layout, so every place's
   pattern recurs).
4. After `max_resample_rounds` extra rounds the places still empty keep their zero-variance groups (trained as
   'train' would: advantage 0, in the normaliser), with a warning: a long run must not stop here.
5. The kept round is normalised like any round: advantages from its own rewards, the global token normaliser over
   its tokens (`RoundBuilder`).

Shapes: `G` completions per group, `P` groups per round, `R` rows per process, `N` processes, `F` reward functions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grpo_trainer.data.sampler import PromptDraws

__all__ = ["Block", "Layout", "ResampleSettings", "Resampler", "Selection", "group_blocks", "match_places",
           "prompts_per_extra_round"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")  # the trainer's one logger (as TRL's is)

Block = tuple[int, int, int]  # (process, first row on that process, rows)


@dataclass(frozen=True)
class Layout:
    num_processes: int = 1
    process_index: int = 0
    num_generations: int = 2


@dataclass(frozen=True)
class ResampleSettings:
    max_rounds: int = 4  # `max_resample_rounds`


def group_blocks(groups: int, num_generations: int, rows_per_process: int) -> list[tuple[Block, ...]]:
    """For each of `groups` groups of a round laid out as decision 1 says, its rows on each process it touches."""
    blocks = []
    for p in range(groups):
        first, end = p * num_generations, (p + 1) * num_generations  # global rows [first, end)
        pieces = []
        for process in range(first // rows_per_process, (end - 1) // rows_per_process + 1):
            start, stop = max(first, process * rows_per_process), min(end, (process + 1) * rows_per_process)
            pieces.append((process, start - process * rows_per_process, stop - start))
        blocks.append(tuple(pieces))
    return blocks


def _pattern(blocks: tuple[Block, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((process, rows) for process, _, rows in blocks)


def match_places(empty: Sequence[int], place_blocks: Sequence[tuple[Block, ...]], candidates: Sequence[int],
                 candidate_blocks: Sequence[tuple[Block, ...]]) -> dict[int, int]:
    """Empty place -> the informative candidate group that fills it (decision 1): places in order, each taking the
    first unused candidate whose rows lie on the same processes in the same numbers."""
    unused: dict[tuple, list[int]] = {}
    for q in candidates:
        unused.setdefault(_pattern(candidate_blocks[q]), []).append(q)
    filled = {}
    for p in empty:
        queue = unused.get(_pattern(place_blocks[p]))
        if queue:
            filled[p] = queue.pop(0)
    return filled


def prompts_per_extra_round(layout: Layout, rows_per_process: int, groups: int, empty_per_process: Sequence[int],
                            informative_share: float) -> int:
    """Prompts one extra round draws over all processes (decision 3)."""
    G, N = layout.num_generations, layout.num_processes
    if rows_per_process % G:
        return groups
    own_groups = rows_per_process // G
    if informative_share <= 0:
        return own_groups * N
    per_process = math.ceil(max(empty_per_process) / informative_share)
    return min(max(per_process, 1), own_groups) * N


@dataclass
class Selection:
    """Where the kept round's rows come from: `blocks` (generation round, first row on this process, rows) in the
    kept round's order on this process; `global_rows` (generation round, global row) in the kept round's global
    order (its rewards and logged rows); and the statistics logged for the round."""

    blocks: list[tuple[int, int, int]]
    global_rows: list[tuple[int, int]]
    extra_rounds: int
    prompts_generated: int
    zero_variance_fraction: float  # over every group generated for the round
    kept_zero_variance: int  # places left with a zero-variance group (decision 4)


# rows for this process -> that generation round's rewards over every process [B_global, F]
SampleRound = Callable[[list[dict]], Tensor]


class Resampler:
    """Decisions 1-4 for one run: `fill` takes a round's gathered rewards and draws, generates and places extra
    prompts through `sample`; `state_dict` is the prompt stream's position (part of a checkpoint)."""

    def __init__(self, settings: ResampleSettings, dataset: Any, layout: Layout, seed: int,
                 is_zero_variance: Callable[[Tensor], Tensor]) -> None:
        self.settings, self.dataset, self.layout = settings, dataset, layout
        self.draws = PromptDraws(len(dataset), seed)
        self.is_zero_variance = is_zero_variance  # rewards [B_global, F] -> [P] bool

    def state_dict(self) -> dict[str, int]:
        return self.draws.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.draws.load_state_dict(state)

    def fill(self, rewards: Tensor, rows_per_process: int, sample: SampleRound) -> Selection:
        """The kept round for a round whose rewards `[B_global, F]` came from `rows_per_process` rows per process."""
        G, N, me = self.layout.num_generations, self.layout.num_processes, self.layout.process_index
        groups = rewards.shape[0] // G
        places = group_blocks(groups, G, rows_per_process)
        zero = self.is_zero_variance(rewards).tolist()  # [P]
        source = [(0, p) for p in range(groups)]  # place -> (generation round, group)
        rounds_blocks = [places]
        seen, informative = groups, groups - sum(zero)
        extra = 0
        while extra < self.settings.max_rounds:
            empty = [p for p in range(groups) if zero[p]]
            if not empty:
                break
            on_process = [sum(1 for p in empty for process, _, _ in places[p] if process == i) for i in range(N)]
            count = prompts_per_extra_round(self.layout, rows_per_process, groups, on_process, informative / seen)
            rows_each = count * G // N
            indices = self.draws.draw(count)
            global_rows = [self.dataset[i] for i in indices for _ in range(G)]
            extra += 1
            new_rewards = sample(global_rows[me * rows_each:(me + 1) * rows_each])
            new_zero = self.is_zero_variance(new_rewards).tolist()
            blocks = group_blocks(count, G, rows_each)
            rounds_blocks.append(blocks)
            seen, informative = seen + count, informative + count - sum(new_zero)
            filled = match_places(empty, places, [q for q in range(count) if not new_zero[q]], blocks)
            for p, q in filled.items():
                source[p], zero[p] = (extra, q), False
        left = sum(zero)
        if left:
            logger.warning(f"zero_variance_groups='resample': {left} of {groups} groups still have equal rewards after "
                           f"{extra} extra generation rounds (max_resample_rounds={self.settings.max_rounds}); they "
                           "stay in the round with advantage 0. Raise max_resample_rounds, or check that the rewards "
                           "can differ within a group.")
        return self._selection(source, rounds_blocks, extra, seen, (seen - informative) / seen, left)

    def _selection(self, source: list[tuple[int, int]], rounds_blocks: list[list[tuple[Block, ...]]], extra: int,
                   seen: int, zero_fraction: float, left: int) -> Selection:
        G, me = self.layout.num_generations, self.layout.process_index
        blocks, global_rows = [], []
        for chunk, group in source:
            global_rows.extend((chunk, group * G + j) for j in range(G))
            blocks.extend((chunk, first, rows) for process, first, rows in rounds_blocks[chunk][group]
                          if process == me)
        return Selection(blocks, global_rows, extra, seen, zero_fraction, left)
