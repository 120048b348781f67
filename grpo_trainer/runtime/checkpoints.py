"""Checkpoints that can be trusted: the latest *complete* one, and a clean save when the job is told to stop.

Decisions:

1. `Trainer` writes `trainer_state.json` after the weights, optimizer, scheduler and RNG states (and, with this
   trainer, the generation buffer); a checkpoint whose `trainer_state.json` is missing or unreadable was cut off
   mid-write and is never resumed from.
2. SIGTERM (what schedulers such as Slurm and Kubernetes send before killing a job) asks the Trainer to save a
   checkpoint at the end of the current optimizer step and to stop; `train()` then returns normally.
3. Resuming restores every weight. `save_pretrained` writes some models' weights under other names than the
   model's own (vision-language models: `model.language_model.*` is saved as `model.*`), and `Trainer` reloads a
   checkpoint's names as they are, with a warning, leaving those weights at their initial values. Such a
   checkpoint is read back with `from_pretrained`, which maps the names, and copied into the model.
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

import torch
from torch import nn
from transformers import PreTrainedModel, TrainerCallback

__all__ = ["is_complete", "latest_complete", "load_renamed_weights", "save_on_sigterm"]

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


def load_renamed_weights(model: nn.Module, checkpoint: str) -> bool:
    """Load a checkpoint's full weights into `model` when they are saved under other names than the model's own
    (decision 3); False (nothing loaded) for any other model or checkpoint, which `Trainer` loads itself."""
    path = os.path.join(checkpoint, "model.safetensors")
    if not isinstance(model, PreTrainedModel) or not os.path.isfile(path):
        return False
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        saved = set(f.keys())
    if saved <= set(model.state_dict()):
        return False
    dtype = next(model.parameters()).dtype
    reloaded = type(model).from_pretrained(checkpoint, dtype=dtype, device_map="cpu")
    missing, unexpected = model.load_state_dict(reloaded.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the checkpoint {checkpoint} does not hold this model's weights (missing: "
                           f"{missing[:5]}, unexpected: {unexpected[:5]}).")
    del reloaded
    with torch.no_grad():
        model.tie_weights()
    return True
