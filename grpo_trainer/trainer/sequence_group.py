"""Sequence parallelism's part of a training step (docs/DISTRIBUTED.md, "Sequence parallelism"), one implementation
per layout behind one interface, so the trainer never tests `sp_size`:

- `Unsharded`: every run without `parallelism_config.sp_size > 1`; each method is the identity.
- `UlyssesGroup`: every process of the run is one group. Each process samples its own rows as under DDP; each
  micro-batch (with its old and reference log-probs, computed unsharded) is then gathered over the group, so every
  process holds the group's rows and runs the policy forward on its slice of their positions through DeepSpeed's
  Ulysses attention (`modeling.sequence_parallel`). The loss is scaled so that DDP's mean of the processes'
  gradients is the unsharded run's (`algorithms.losses.sequence_parallel_scale`), and the logged loss divided back.

Accelerate and the Trainer must not see `sp_size` (`hidden_from_accelerate`): their Ulysses path wants a DeepSpeed
engine and re-shards the prompt data loader, while GRPO's sequences exist only after generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.algorithms import losses
from grpo_trainer.modeling import routing, sequence_parallel
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.scoring import PolicyScorer

__all__ = ["SequenceGroup", "UlyssesGroup", "Unsharded", "sequence_group"]


class SequenceGroup:
    """The interface (and `Unsharded`'s identity behaviour)."""

    size = 1

    def hidden_from_accelerate(self, args: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def attach(self, model: nn.Module, scorer: PolicyScorer) -> None:
        """Make `scorer`'s training forwards of `model` sharded (after the model is prepared)."""

    def rows(self, micro: Round, pad_token_id: int) -> Round:
        """The micro-batch this process trains on."""
        return micro

    def loss(self, loss: Tensor) -> Tensor:
        """The training loss to back-propagate."""
        return loss

    def logged(self, loss: Tensor) -> Tensor:
        """The loss `training_step` reports (the unsharded run's)."""
        return loss

    def step_done(self) -> None:
        """A micro-step's backward is done (its recomputed forwards too)."""


class Unsharded(SequenceGroup):
    pass


class UlyssesGroup(SequenceGroup):
    def __init__(self, size: int, loss_type: str) -> None:
        self.size, self.scale = size, losses.sequence_parallel_scale(loss_type, size)

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

    def rows(self, micro: Round, pad_token_id: int) -> Round:
        parts: list[Round | None] = [None] * self.size
        torch.distributed.all_gather_object(parts, micro)
        return dataclasses.replace(Round.concat(parts, pad_token_id), window_tokens=micro.window_tokens)

    def loss(self, loss: Tensor) -> Tensor:
        return loss * self.scale  # DDP's mean over the group against the rows' aggregation

    def logged(self, loss: Tensor) -> Tensor:
        # After `loss`'s scale the group's loss is `size` times the mean of the unsharded processes' losses, for
        # every aggregation (algorithms.losses): the logged value is that mean
        return loss / self.size

    def step_done(self) -> None:
        sequence_parallel.deactivate()


def sequence_group(args: Any) -> SequenceGroup:
    """The layout `args.parallelism_config` asks for (config.checks refuses what does not combine with it)."""
    size = getattr(args.parallelism_config, "sp_size", None) or 1
    return UlyssesGroup(size, args.loss_type) if size > 1 else Unsharded()
