"""Where the trainer takes its rounds from: one interface (`RoundSource`) with a synchronous implementation
(`SyncRounds`, here) and an asynchronous one (`trainer.producer.AsyncRounds`, a producer thread sampling ahead).

Decisions:

1. The trainer asks its source for a training round's prepared micro-batches (`training_round`) and for an
   evaluation round (`evaluation_round`); a checkpoint stores what `run_state` returns and gives it back to
   `load_run_state`; `callbacks` are the Trainer events the source keeps pace with; `close` ends whatever it runs.
   Nothing else of the trainer, its checkpoint state or its set-up knows how rounds are made.
2. Every round is built the same way (`build`): `RoundBuilder` (prompts -> rollout -> rewards -> advantages), then
   `trainer.off_policy` (old log-probs, importance weights, the mismatch report), then the completions table. The
   trainer's `_generate_and_score` (TRL's hook) is `build`; a source that builds on the main thread calls the hook
   (`generate`), so a subclass or a test that wraps it sees every round.
3. `trainer.parts.source_type` is the one place that chooses the implementation; each implementation says
   how many rounds it samples ahead and how they are corrected (`sampled_ahead`: the schedule and the off-policy
   owner read it), and refuses what it cannot run before any model loads (`check`) and once the policy exists
   (`check_model`). They read the run through one typed object, `SourceSettings` (`trainer.parts.source_settings`),
   never the config.

Shapes: none (rounds are `Round`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerState

from grpo_trainer.planning.settings import RoundsHeld
from grpo_trainer.runtime.distributed import Launch
from grpo_trainer.trainer.off_policy import OffPolicy
from grpo_trainer.trainer.round import Round
from grpo_trainer.trainer.round_builder import PolicyView, RoundBuilder
from grpo_trainer.trainer.schedule import RoundBuffer
from grpo_trainer.trainer.scoring import PolicyScorer

__all__ = ["RoundSource", "SourceSettings", "SyncRounds"]


@dataclass(frozen=True)
class SourceSettings:
    """What a round source and its refusals read of a run (decision 3)."""

    rounds_ahead: int = 0  # `async_rollouts`: 0 synchronous
    correction: str = "behaviour"  # `async_correction`
    seed: int = 42  # the run's (`seed`)
    timeout: float | None = None  # `async_rollout_timeout`
    launch: Launch = field(default_factory=Launch)
    vllm_mode: str = "colocate"
    vllm_tensor_parallel_size: int = 1
    mismatch_report: bool = False  # `sampling_mismatch_report`


class RoundSource(ABC):
    """Decisions 1 and 2. `generate(rows, mode)`: the trainer's `_generate_and_score`, which is `build`."""

    def __init__(self, builder: RoundBuilder, corrections: OffPolicy, scorer: PolicyScorer, buffer: RoundBuffer,
                 generate: Callable[[list[dict], str], Round]) -> None:
        self.builder, self.corrections, self.scorer, self.buffer = builder, corrections, scorer, buffer
        self.generate = generate

    @classmethod
    @abstractmethod
    def sampled_ahead(cls, settings: SourceSettings) -> tuple[int, str | None]:
        """How many rounds this source samples before the weights that train them exist, and how they are corrected
        for it (`trainer.off_policy`'s `ahead`; None: they are not)."""

    @classmethod
    @abstractmethod
    def held(cls, settings: SourceSettings) -> RoundsHeld:
        """What this source holds beside the round that trains, for the memory plan (`planning.estimate`)."""

    @classmethod
    @abstractmethod
    def check(cls, settings: SourceSettings, backend: Any, train_dataset: Any, rollout_func: Any) -> None:
        """Refuse, before any model loads or the backend is built, what this source cannot run (decision 3);
        `backend`: the chosen backend's class (`rollout.backend.chosen`)."""

    @classmethod
    @abstractmethod
    def check_model(cls, model: nn.Module, settings: SourceSettings, in_process: bool) -> None:
        """Refuse a policy this source cannot run (decision 3)."""

    @staticmethod
    def checkpointing_kwargs(in_process: bool) -> dict[str, bool]:
        """Activation checkpointing kwargs this source needs by default (`gradient_checkpointing_kwargs`)."""
        return {}

    def build(self, rows: list[dict], mode: str, policy: PolicyView, state: TrainerState) -> Round:
        """One corrected round from this process's dataset rows, logged to the completions table (decision 2)."""
        round_, log = self.builder.build(rows, mode, policy, state)
        round_, columns = self.corrections.correct(round_, mode, policy.model, policy.version)
        self.builder.log(log, columns)
        return round_

    @abstractmethod
    def training_round(self, micro_step: int, rows: list[dict], model: nn.Module, state: TrainerState
                       ) -> list[Round]:
        """The prepared micro-batches of the training round that starts at `micro_step`; `rows`: the dataloader's
        rows for it."""

    def evaluation_round(self, rows: list[dict]) -> Round:
        """An evaluation round from `rows`, built on the main thread."""
        return self.generate(rows, "eval")

    def callbacks(self) -> list[TrainerCallback]:
        return []

    def run_state(self, stuck: bool = False) -> dict[str, Any]:
        """What a checkpoint keeps of the rounds: the buffer's state; `stuck`: saved while a rollout may hang."""
        return self.buffer.state_dict()

    def load_run_state(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)

    @abstractmethod
    def close(self) -> None:
        """End whatever the source runs (nothing is left running at the end of `train`)."""


class SyncRounds(RoundSource):
    """Rounds built when the trainer asks for them, with the weights it has then: every set-up can run them, and
    nothing runs between two asks."""

    @classmethod
    def sampled_ahead(cls, settings: SourceSettings) -> tuple[int, str | None]:
        return 0, None

    @classmethod
    def held(cls, settings: SourceSettings) -> RoundsHeld:
        return RoundsHeld()

    @classmethod
    def check(cls, settings: SourceSettings, backend: Any, train_dataset: Any, rollout_func: Any) -> None:
        return None

    @classmethod
    def check_model(cls, model: nn.Module, settings: SourceSettings, in_process: bool) -> None:
        return None

    def close(self) -> None:
        return None

    def training_round(self, micro_step: int, rows: list[dict], model: nn.Module, state: TrainerState
                       ) -> list[Round]:
        round_ = self.generate(rows, "train")
        return [self.scorer.prepare(part, "train", model) for part in round_.split(self.buffer.schedule
                                                                                   .steps_per_generation)]
