"""Sequence parallelism's part of a training step (docs/DISTRIBUTED.md, "Sequence parallelism"), one implementation
per layout behind one interface, so the trainer never tests `sp_size`:

- `Unsharded`: every run without `parallelism_config.sp_size > 1`; each method is the identity.
- `UlyssesGroup`: every process of the run is one group. Each process samples its own rows as under DDP; each
  micro-batch (with its old and reference log-probs, computed by sharded forwards: `PolicyScorer.prepare`) is then
  gathered over the group, and the group trains on one process's rows at a time, as ALST does (arXiv:2506.13996):
  every process runs the policy forward of that share on its slice of the positions through DeepSpeed's Ulysses
  attention (`modeling.sequence_parallel`), computes that share's loss (the loss its own process computes under DDP) and
  back-propagates through its positions, DDP's all-reduce held back (`no_sync`) until the last share. A process
  then holds one share's activations at `1 / sp_size` of their positions: `per_device_train_batch_size` rows of
  `N / sp_size` tokens, where DDP holds them at `N`. The gradients summed over shares and averaged by DDP over the
  group are DDP's mean of the per-process losses' gradients, for every aggregation: no factor on the loss.

Accelerate and the Trainer must not see `sp_size` (`hidden_from_accelerate`): their Ulysses path wants a DeepSpeed
engine and re-shards the prompt data loader, while GRPO's sequences exist only after generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling import routing, sequence_parallel
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.scoring import PolicyScorer

__all__ = ["SequenceGroup", "Shares", "UlyssesGroup", "Unsharded", "sequence_group"]


# objective(share, last): the loss of one micro-batch; `last` is False for a share whose backward is followed by
# another's in the same micro-step (the optimizer-step bookkeeping, such as adaptive entropy control, waits for it).
Objective = Callable[[Round, bool], Tensor]


@dataclass(frozen=True)
class Shares:
    """A sequence-parallel group's micro-batches, one per process in rank order (every process holds them all)."""

    rounds: tuple[Round, ...]


class SequenceGroup:
    """The interface (and `Unsharded`'s identity behaviour)."""

    size = 1

    def hidden_from_accelerate(self, args: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def attach(self, model: nn.Module, scorer: PolicyScorer) -> None:
        """Make `scorer`'s training forwards of `model` sharded (after the model is prepared)."""

    def rows(self, micro: Round) -> Round | Shares:
        """What this process's micro-step trains on."""
        return micro

    def loss(self, objective: Objective, inputs: Round | Shares, model: nn.Module,
             backward: Callable[[Tensor], None]) -> Tensor:
        """The training loss the Trainer back-propagates; a group runs `backward` itself for what comes before."""
        return objective(inputs, True)

    def logged(self, loss: Tensor) -> Tensor:
        """The loss `training_step` reports (the unsharded run's)."""
        return loss

    def step_done(self) -> None:
        """A micro-step's backward is done (its recomputed forwards too)."""


class Unsharded(SequenceGroup):
    pass


class UlyssesGroup(SequenceGroup):
    def __init__(self, size: int) -> None:
        self.size = size
        self._earlier: list[Tensor] = []  # this micro-step's shares' losses before the last (detached)

    @contextlib.contextmanager
    def hidden_from_accelerate(self, args: Any) -> Iterator[None]:
        config, args.parallelism_config = args.parallelism_config, None
        try:
            yield
        finally:
            args.parallelism_config = config

    def attach(self, model: nn.Module, scorer: PolicyScorer) -> None:
        # The sharded forward neither replays a rollout's routes nor returns the router's auxiliary loss: a
        # Mixture-of-Experts model would train silently without both
        if routing.find_routers(causal_lm(model)):
            raise ValueError("parallelism_config.sp_size > 1 cannot train a Mixture-of-Experts model: the sequence-"
                             "sharded policy forward does not replay the rollout's expert routes (routing_replay) nor "
                             "return the router's auxiliary loss. Train it without sp_size (one device: "
                             "gradient_checkpointing, logprob_chunk_size, `grpo-train plan`).")
        sequence_parallel.install(model)
        scorer.sp_group = torch.distributed.group.WORLD

    def rows(self, micro: Round) -> Shares:
        parts: list[Round | None] = [None] * self.size
        torch.distributed.all_gather_object(parts, micro)
        return Shares(tuple(parts))

    def loss(self, objective: Objective, inputs: Shares, model: nn.Module,
             backward: Callable[[Tensor], None]) -> Tensor:
        # DDP decides at the forward whether the next backward all-reduces: each share before the last runs its
        # forward and backward under no_sync, its gradients accumulating locally; the last one's backward (the
        # Trainer's) all-reduces the sum
        self._earlier = []
        for share in inputs.rounds[:-1]:
            with model.no_sync():
                loss = objective(share, False)
                backward(loss)
            self._earlier.append(loss.detach())
        return objective(inputs.rounds[-1], True)

    def logged(self, loss: Tensor) -> Tensor:
        # Every process computed every share's loss: their mean is DDP's mean of the processes' losses
        total = loss + sum(self._earlier)
        self._earlier = []
        return total / self.size

    def step_done(self) -> None:
        sequence_parallel.deactivate()


def sequence_group(args: Any) -> SequenceGroup:
    """The layout `args.parallelism_config` asks for (config.checks refuses what does not combine with it)."""
    size = getattr(args.parallelism_config, "sp_size", None) or 1
    return UlyssesGroup(size) if size > 1 else Unsharded()
