"""Checkpoints that can be trusted: the latest *complete* one, and a clean save when the job is told to stop.

Decisions:

1. `Trainer` writes `trainer_state.json` after the weights, optimizer, scheduler and RNG states (and, with this
   trainer, the generation buffer); a checkpoint whose `trainer_state.json` is missing or unreadable was cut off
   mid-write and is never resumed from.
2. SIGTERM (what schedulers such as Slurm and Kubernetes send before killing a job) asks the Trainer to save a
   checkpoint at the end of the current optimizer step and to stop; `train()` then returns normally.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

__all__ = ["is_complete", "latest_complete", "save_on_sigterm"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def is_complete(path: str) -> bool:
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def latest_complete(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step under `output_dir`, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))),
                   reverse=True)
    return next((os.path.join(output_dir, name) for _, name in steps if is_complete(os.path.join(output_dir, name))),
                None)


class _StopAndSave(TrainerCallback):
    def __init__(self) -> None:
        self.requested = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.requested:
            control.should_save = True
            control.should_training_stop = True
        return control


@contextlib.contextmanager
def save_on_sigterm(trainer: Any) -> Iterator[None]:
    """While training, turn SIGTERM into "save a checkpoint after this step, then stop"."""
    if threading.current_thread() is not threading.main_thread():  # signals can only be handled there
        yield
        return
    callback = _StopAndSave()

    def handle(signum: int, frame: Any) -> None:
        warnings.warn("SIGTERM received: saving a checkpoint after the current step, then stopping.")
        callback.requested = True

    trainer.add_callback(callback)
    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        trainer.remove_callback(callback)
