"""Run by `accelerate launch` (2 processes over gloo) from test_collectives.py: the trainer's cross-process
reductions of TRL's loss options with real collectives. Each process writes what it computed to
`--out/rank<i>.json`.

- `GRPOTrainer.get_high_entropy_mask`: the quantile over both processes' completion-token entropies, with
  different token counts per process (the padding to a common length must be dropped).
- `clip_ratio/low_min` / `high_max`: per-completion values gathered, then the NaN-ignoring min / max.
- adaptive entropy control: the window's entropy is the token-weighted mean over both processes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather
from teardown import leave_cleanly  # beside this script, on sys.path when it is launched

from grpo_trainer.algorithms.entropy import EntropyControl
from grpo_trainer.algorithms.losses import SEQUENCE_METRICS, LossSettings
from grpo_trainer.reporting.metrics import MetricsWindow
from grpo_trainer.trainer.loss import GRPOLoss, LossPartSettings

# Process 0: 5 completion tokens; process 1: 2 (so the gather pads process 1's to 5).
ENTROPIES = [torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.0, 9.0]]), torch.tensor([[2.0, 3.0, 8.0, 8.0]])]
MASKS = [torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), torch.tensor([[1, 1, 0, 0]])]
LOW_FRACTIONS = [torch.tensor([0.5, float("nan")]), torch.tensor([0.25, 0.75])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    accelerator = Accelerator()
    rank = accelerator.process_index
    entropy, mask = ENTROPIES[rank], MASKS[rank]
    reduce = SEQUENCE_METRICS["clip_ratio/low_min"][1]
    low_min = reduce(gather(LOW_FRACTIONS[rank]))
    window = MetricsWindow()
    objective = GRPOLoss(LossPartSettings(LossSettings()), scorer=None, accelerator=accelerator, metrics_window=window,
                         entropy=EntropyControl(coef=0.1, adaptive=True, target=1.0, step=0.05))
    kept = objective.high_entropy_mask(entropy, mask, 0.5)
    objective.control_entropy(entropy, mask.float(), sync_gradients=True)
    result = {"num_processes": accelerator.num_processes, "kept": kept.int().tolist(), "low_min": low_min.item(),
              "window_entropy": objective.entropy.last_entropy, "coef": objective.entropy.coef,
              "logged_coef": window["train"]["entropy_coef"]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave_cleanly()


if __name__ == "__main__":
    main()
