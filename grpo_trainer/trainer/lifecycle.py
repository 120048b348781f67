"""What a checkpoint holds beyond the Trainer's own files, so that a resumed run continues exactly: the round
source's state (the round buffer and its position, and an asynchronous source's rounds sampled ahead), dynamic
sampling's prompt stream, partial rollouts' parked groups and the rollout backend's state (speculative rollouts'
history; each process its own file), and the adaptive entropy controller (one file, TRL's name and keys). All live
inside the checkpoint folder, so its manifest covers them (`runtime.checkpoints`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from grpo_trainer.algorithms.entropy import EntropyControl
from grpo_trainer.rollout.backend import RolloutBackend
from grpo_trainer.rollout.partial.parking import PartialRollouts
from grpo_trainer.trainer.resample import Resampler
from grpo_trainer.trainer.source import RoundSource

__all__ = ["ENTROPY_STATE", "RunParts", "load_run_state", "save_run_state"]

ENTROPY_STATE = "entropy_ctrl_state.json"  # the adaptive entropy controller's state in a checkpoint (TRL's name)


def _buffer_file(folder: str, process_index: int) -> str:
    return os.path.join(folder, f"grpo_state_{process_index}.pt")


def save_run_state(folder: str, process_index: int, state: dict[str, Any], entropy: EntropyControl,
                   writes_shared_files: bool) -> None:
    """This process's `state` (`RunParts.state_dict`); the entropy controller's state once (`writes_shared_files`:
    the process that writes the run's shared files)."""
    torch.save(state, _buffer_file(folder, process_index))
    if entropy.adaptive and writes_shared_files:  # the same on every process
        with open(os.path.join(folder, ENTROPY_STATE), "w") as f:
            json.dump(entropy.state_dict(), f)


def load_run_state(folder: str, process_index: int, device: torch.device, entropy: EntropyControl
                   ) -> dict[str, Any] | None:
    """This process's buffer state from `folder` (None when the checkpoint has none), after restoring the entropy
    controller's state into `entropy`."""
    entropy_state = os.path.join(folder, ENTROPY_STATE)
    if entropy.adaptive and os.path.isfile(entropy_state):
        with open(entropy_state) as f:
            entropy.load_state_dict(json.load(f))
    path = _buffer_file(folder, process_index)
    if not os.path.isfile(path):
        return None
    # "cpu:0" under a multi-process CPU launch is a device torch cannot map to
    return torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=False)


@dataclass(frozen=True)
class RunParts:
    """The trainer's parts whose state a checkpoint keeps per process: the round source's (the buffer, and any
    rounds it sampled ahead, `trainer.source`), dynamic sampling's prompt stream, and the rollout backend's
    (`RolloutBackend.state_dict`: speculative rollouts' history)."""

    source: RoundSource
    resampler: Resampler | None = None
    backend: RolloutBackend | None = None
    partial: PartialRollouts | None = None  # partial rollouts' parked groups and prompt stream


    def state_dict(self, stuck: bool = False) -> dict[str, Any]:
        """`stuck`: saved from the signal watchdog while a rollout may hang (`RoundSource.run_state`)."""
        state = self.source.run_state(stuck)
        if self.resampler is not None:
            state = {**state, "resample": self.resampler.state_dict()}
        if self.partial is not None:
            state = {**state, "partial_rollouts": self.partial.state_dict()}
        backend = None if self.backend is None else self.backend.state_dict()
        return state if backend is None else {**state, "rollout_backend": backend}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_run_state(state)
        if self.resampler is not None and "resample" in state:
            self.resampler.load_state_dict(state["resample"])
        if self.partial is not None and "partial_rollouts" in state:
            self.partial.load_state_dict(state["partial_rollouts"])
        if self.backend is not None and "rollout_backend" in state:
            self.backend.load_state_dict(state["rollout_backend"])
