"""The trainer's side of the training-health checks (docs/HEALTH.md): the monitor (`diagnosis.monitor`) fed from
`GRPOTrainer.log`, its warnings in the run log, and the summary at the end of training.

Decisions:

1. Only the main process watches and writes: every process logs the same reduced metrics, so one copy of each
   warning is enough.
2. The summary is made however `train()` ends: finished, stopped by a callback, interrupted by SIGTERM or SIGINT
   (`runtime.interrupts`: the step ends, a checkpoint is saved, `train()` returns), or by an error. It is logged (a
   warning when something was diagnosed), kept for the model card and the console, and appended to metrics.jsonl
   through the run's `RunLogCallback` (decision 1 of `reporting.run_log`: the file is that callback's). A process
   that exits at once (a second signal, or a step stuck past `signal_grace_period`) writes no summary; the log so far
   still holds every warning, and `grpo-train doctor` rebuilds the summary from it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from grpo_trainer.diagnosis.monitor import HealthMonitor, Summary
from grpo_trainer.reporting.run_log import RunLogCallback

__all__ = ["TrainingHealth", "stop_reason"]

logger = logging.getLogger("grpo_trainer.trainer.grpo_trainer")  # the trainer's log, where its other warnings go


def stop_reason(step: int, max_steps: int, signum: int | None, error: BaseException | None) -> str:
    """How `train()` ended, in the summary's words."""
    if error is not None:
        return f"stopped by {type(error).__name__} at step {step}"
    if signum is not None:
        return f"interrupted by {signal.Signals(signum).name} at step {step}"
    return f"finished at step {step}" if step >= max_steps else f"stopped at step {step}"


class TrainingHealth:
    """`observe` at each training log step, `finish` when `train()` ends; `summary` after (decisions 1-2)."""

    def __init__(self, monitor: HealthMonitor | None, main_process: bool) -> None:
        self.monitor = monitor if main_process else None
        self.summary: Summary | None = None

    def observe(self, step: int, logs: dict[str, Any]) -> None:
        if self.monitor is not None:
            for note in self.monitor.observe(step, logs):
                (logger.warning if note.onset else logger.info)(note.text)

    def start(self) -> None:
        self.summary = None

    def finish(self, stopped: str, callbacks: Iterable[TrainerCallback], args: TrainingArguments,
               state: TrainerState, control: TrainerControl) -> None:
        if self.monitor is None:
            return
        self.summary = self.monitor.summary(stopped)
        (logger.warning if self.summary.episodes else logger.info)("\n".join(self.summary.lines()))
        for callback in callbacks:
            if isinstance(callback, RunLogCallback):
                callback.on_log(args, state, control, logs={"health": self.summary.record()})

    def card_lines(self, step: int) -> tuple[str, ...]:
        """The model card's health section: the summary, or during training the summary so far."""
        summary = self.summary or (self.monitor.summary(f"in progress at step {step}") if self.monitor else None)
        return tuple(summary.lines()) if summary is not None else ()
