"""When a generation round is made and which micro-batch each micro-step trains on, and the buffer that serves
them.

Decisions:

1. One round serves `steps_per_generation x num_iterations` micro-steps: it is cut into `steps_per_generation`
   micro-batches, each trained on `num_iterations` times, in order (the first pass over all of them, then the
   second, ...), as in TRL.
2. A round is on-policy when every one of its micro-steps runs before the next optimizer step
   (`gradient_accumulation_steps` a multiple of its micro-steps): the sampling weights are then the weights every
   loss runs under, so the rollout's own values stand in for the forward's (`rollout.capture`). Evaluation is always
   on-policy.
3. The buffer's state (the prepared micro-batches and the micro-step counter) is part of a checkpoint, so a resumed
   run trains on exactly the micro-batches the interrupted one would have.
4. A buffered micro-batch drops its replay tensors at its last loss (`Round.without_replay`), so they do not outlive
   their backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator
from accelerate.utils import gather
from torch import Tensor

from grpo_trainer.trainer.round import Round

__all__ = ["RoundBuffer", "Schedule", "window_tokens"]


@dataclass(frozen=True)
class Schedule:
    steps_per_generation: int = 1
    num_iterations: int = 1
    gradient_accumulation_steps: int = 1
    rounds_ahead: int = 0  # `async_rollouts`: training rounds were sampled before the latest weights

    @property
    def micro_steps_per_round(self) -> int:
        return self.steps_per_generation * self.num_iterations

    def on_policy(self, mode: str) -> bool:
        """Decision 2 (a round sampled ahead, `trainer.producer`, is not: the weights moved since)."""
        return mode != "train" or (self.rounds_ahead == 0
                                   and self.gradient_accumulation_steps % self.micro_steps_per_round == 0)

    def position(self, micro_step: int) -> tuple[int, int]:
        """(iteration, micro-batch index) that `micro_step` trains on (decision 1)."""
        return divmod(micro_step % self.micro_steps_per_round, self.steps_per_generation)


def window_tokens(loss_mask: Tensor, mode: str, schedule: Schedule, accelerator: Accelerator) -> Tensor:
    """The `dapo` normaliser of a round whose loss mask is `loss_mask` `[B, T]`: active tokens per process per
    gradient-accumulation window (evaluation: each batch on its own). A collective in training."""
    if mode == "eval":
        return loss_mask.sum().float()
    global_tokens = gather(loss_mask.sum().reshape(1).float()).sum()
    return global_tokens / accelerator.num_processes * schedule.gradient_accumulation_steps \
        / schedule.steps_per_generation


class RoundBuffer:
    """Serves a round's prepared micro-batches, one per micro-step, and asks for a new round when one is used up."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.parts: list[Round] | None = None  # the current round's prepared micro-batches
        self.micro_step = 0

    def next(self, make_round: Callable[[], list[Round]]) -> Round:
        """The micro-batch for this micro-step; `make_round()` (the round's prepared micro-batches) is called at a
        round's first micro-step."""
        iteration, index = self.schedule.position(self.micro_step)
        if (iteration, index) == (0, 0) or self.parts is None:
            self.parts = make_round()
        part = self.parts[index]
        if iteration == self.schedule.num_iterations - 1:  # decision 4
            self.parts[index] = part.without_replay()
        self.micro_step += 1
        return part

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.parts, "micro_step": self.micro_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parts, self.micro_step = state["buffer"], state["micro_step"]
