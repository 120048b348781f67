"""Which prompt goes to which process and micro-step.

`per_device_train_batch_size` counts completions (as in TRL). The sampler yields each prompt index `G` times in a
row, takes prompts in chunks that fill one generation round, and yields each chunk `repeat_count` times
(`steps_per_generation x num_iterations`): the Trainer's step accounting stays right while the trainer generates
once per round and serves the other micro-steps from its buffer. Every process draws the same permutation
(seeded by `seed + epoch`), so all agree on which prompts form each round and each group; accelerate then hands
each process its own slice.

    G=3, prompts per round=2, repeat_count=2, permutation [4, 1, 7, 0, ...]:
    4 4 4 1 1 1 | 4 4 4 1 1 1 | 7 7 7 0 0 0 | 7 7 7 0 0 0 | ...

`PromptDraws` is a second, independent stream of prompt indices (dynamic sampling's extra prompts): successive seeded
permutations of the dataset, read in order, whose position is saved in checkpoints so a resumed run draws the same
prompts.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler
from transformers import TrainingArguments

__all__ = ["PromptDraws", "RepeatSampler", "RoundSource", "repeat_iterable", "streaming_eval"]


class RepeatSampler(Sampler[int]):
    """Indices of `data_source`, grouped and repeated as described in the module docstring.

    An incomplete trailing chunk of prompts is dropped (it could not fill a generation round).
    """

    def __init__(self, data_source: Sized, mini_repeat_count: int, batch_size: int = 1, repeat_count: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = len(data_source)
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer at each epoch: a new, reproducible permutation (exact resume needs this)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        chunks = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for chunk in chunks:
            if len(chunk) < self.batch_size:
                return
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


class _RepeatedStream(IterableDataset):
    def __init__(self, rows: Iterable[dict], mini_repeat_count: int, batch_size: int, repeat_count: int) -> None:
        self.rows, self.mini_repeat_count, self.batch_size, self.repeat_count = (
            rows, mini_repeat_count, batch_size, repeat_count)

    def __iter__(self) -> Iterator[dict]:
        chunk: list[dict] = []
        for row in self.rows:
            chunk.append(row)
            if len(chunk) < self.batch_size:
                continue
            for _ in range(self.repeat_count):
                for kept in chunk:
                    yield from [kept] * self.mini_repeat_count
            chunk = []


def streaming_eval(args: TrainingArguments) -> TrainingArguments:
    """The arguments an eval dataloader over a stream is built with: a copy of `args` without worker processes, so
    that each prompt's repeats stay together (`args` itself is left as it is). Batches must not be dispatched from
    the main process (each process reads its own share): `dispatch_batches=True` is refused by name."""
    if args.accelerator_config.dispatch_batches:
        raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                         "`accelerator_config`; set it to False, or pass a map-style eval dataset.")
    streaming = copy.copy(args)
    streaming.dataloader_num_workers = 0
    return streaming


def repeat_iterable(rows: Iterable[dict], mini_repeat_count: int, batch_size: int = 1,
                    repeat_count: int = 1) -> IterableDataset:
    """The `RepeatSampler` order for a stream (an `IterableDataset` has no indices to sample): each row
    `mini_repeat_count` times, chunks of `batch_size` rows `repeat_count` times, incomplete last chunk dropped."""
    return _RepeatedStream(rows, mini_repeat_count, batch_size, repeat_count)


class RoundSource:
    """The dataset rows of any generation round on this process, without iterating a dataloader: what
    `RepeatSampler` (with `repeat_count` 1) yields for round r, sliced as accelerate hands it to process
    `process_index` (process p takes the p-th of the round's `num_processes` equal slices). Asynchronous rollouts
    read round r + k here while the Trainer's dataloader is at round r; the trainer checks each round against the
    rows the dataloader delivers.

    Rounds count across epochs: round r is chunk `r % rounds_per_epoch` of epoch `r // rounds_per_epoch`, whose
    permutation is the sampler's (`seed + epoch`)."""

    def __init__(self, data_source: Any, num_generations: int, prompts_per_round: int, shuffle: bool, seed: int,
                 process_index: int, num_processes: int) -> None:
        self.data_source, self.num_generations, self.prompts_per_round = data_source, num_generations, prompts_per_round
        self.shuffle, self.seed = shuffle, seed
        self.process_index, self.num_processes = process_index, num_processes
        self.rounds_per_epoch = len(data_source) // prompts_per_round
        if self.rounds_per_epoch == 0:
            raise ValueError(f"the dataset has {len(data_source)} prompts, fewer than one generation round's "
                             f"{prompts_per_round}.")

    def indices(self, round_index: int) -> list[int]:
        """This process's dataset indices of round `round_index` (each prompt G times in a row)."""
        epoch, chunk = divmod(round_index, self.rounds_per_epoch)
        sampler = RepeatSampler(self.data_source, self.num_generations, self.prompts_per_round, 1, self.shuffle,
                                self.seed)
        sampler.set_epoch(epoch)
        per_round = self.prompts_per_round * self.num_generations
        start = chunk * per_round
        expanded = list(itertools.islice(iter(sampler), start, start + per_round))
        local = per_round // self.num_processes
        return expanded[self.process_index * local:(self.process_index + 1) * local]

    def rows(self, round_index: int) -> list[dict]:
        return [self.data_source[i] for i in self.indices(round_index)]


class PromptDraws:
    """An endless stream of indices of a dataset of `num_prompts` rows: permutation 0, then permutation 1, ...,
    permutation `e` seeded by `seed` and `e` alone, so every process that builds one with the same seed draws the
    same indices, and `state_dict` (the permutation and the position in it) is all a resumed run needs. Its seeds
    are apart from `RepeatSampler`'s (`seed + epoch`), so it does not replay the main stream's order."""

    _SEED_STRIDE = 1_000_003  # a prime: permutation e of seed s never shares a seed with RepeatSampler's seed + epoch

    def __init__(self, num_prompts: int, seed: int = 0) -> None:
        if num_prompts < 1:
            raise ValueError("PromptDraws needs a dataset with at least one row.")
        self.num_prompts, self.seed = num_prompts, seed
        self.permutation, self.position = 0, 0

    def _order(self, permutation: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * self._SEED_STRIDE + permutation + 1)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def draw(self, count: int) -> list[int]:
        """The next `count` indices of the stream."""
        drawn: list[int] = []
        while len(drawn) < count:
            order = self._order(self.permutation)
            take = order[self.position:self.position + count - len(drawn)]
            drawn.extend(take)
            self.position += len(take)
            if self.position == self.num_prompts:
                self.permutation, self.position = self.permutation + 1, 0
        return drawn

    def state_dict(self) -> dict[str, int]:
        return {"permutation": self.permutation, "position": self.position, "seed": self.seed,
                "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["num_prompts"]) != (self.seed, self.num_prompts):
            raise ValueError(f"the checkpoint's extra-prompt stream was drawn from {state['num_prompts']} prompts with "
                             f"seed {state['seed']}; this run has {self.num_prompts} prompts and seed {self.seed}. "
                             "Resume with the same train_dataset and seed.")
        self.permutation, self.position = state["permutation"], state["position"]
