"""What a checkpoint holds beyond the Trainer's own files, so that a resumed run continues exactly: the round buffer
and its position, and dynamic sampling's prompt stream (each process its own file), and the adaptive entropy
controller (one file, TRL's name and keys).
Both live inside the checkpoint folder, so its manifest covers them (`runtime.checkpoints`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from grpo_trainer.algorithms.entropy import EntropyControl

__all__ = ["ENTROPY_STATE", "load_run_state", "save_run_state"]

ENTROPY_STATE = "entropy_ctrl_state.json"  # the adaptive entropy controller's state in a checkpoint (TRL's name)


def _buffer_file(folder: str, process_index: int) -> str:
    return os.path.join(folder, f"grpo_state_{process_index}.pt")


def save_run_state(folder: str, process_index: int, buffer_state: dict[str, Any], entropy: EntropyControl,
                   writes_shared_files: bool, resample_state: dict[str, int] | None = None) -> None:
    """`buffer_state` (`RoundBuffer.state_dict`) and `resample_state` (`Resampler.state_dict`, under the key
    "resample") for this process; the entropy controller's state once (`writes_shared_files`: the process that
    writes the run's shared files)."""
    state = buffer_state if resample_state is None else {**buffer_state, "resample": resample_state}
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
