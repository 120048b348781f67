"""Run by `accelerate launch` (2 processes over gloo) from test_resample_multiprocess.py: dynamic sampling where only
one process's groups have equal rewards. Each process writes what it saw to `--out/rank<i>.json`.

The reward: on the process named by `--saturated`, the first reward call of each optimizer step (the step's own
round) gives every completion 1.0 (every group there has equal rewards); every other call, and every call on the
other process, gives each completion its position in the call (0, 1, 2, ...: a group's rewards always differ).
`--layout whole`: 4 rows per process, G = 2 (each process holds 2 whole groups). `--layout spanning`: 3 rows per
process, G = 2 (group 1 has one row on each process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import PartialState
from teardown import leave_cleanly  # beside this script, on sys.path when it is launched

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model, make_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", choices=("whole", "spanning"), required=True)
    parser.add_argument("--saturated", type=int, required=True)
    options = parser.parse_args()
    torch.set_num_threads(1)
    calls: list[tuple[int, list[float]]] = []

    def reward(completions, trainer_state, **kwargs):
        step = trainer_state.global_step
        first_of_step = not calls or calls[-1][0] != step
        values = [1.0] * len(completions) if PartialState().process_index == options.saturated and first_of_step \
            else [float(i) for i in range(len(completions))]
        calls.append((step, values))
        return values

    tokenizer = make_tokenizer()
    rows = 4 if options.layout == "whole" else 3
    args = GRPOConfig(output_dir=str(options.out / "run"), per_device_train_batch_size=rows, num_generations=2,
                      max_completion_length=4, max_steps=2, report_to="none", save_strategy="no", logging_steps=1,
                      seed=0, disable_tqdm=True, use_cpu=True, zero_variance_groups="resample",
                      max_resample_rounds=3)
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=3), reward, args=args,
                          train_dataset=copy_digits_dataset(num_prompts=16), processing_class=tokenizer)
    kept = []
    build = trainer.rounds.build

    def recording(batch, mode, policy, state):
        round_, log = build(batch, mode, policy, state)
        kept.append({"rows": round_.rows, "advantages": round_.advantages.tolist()})
        return round_, log

    trainer.rounds.build = recording
    trainer.train()
    logs = [{k: v for k, v in entry.items() if k.startswith("zero_variance_groups/")}
            for entry in trainer.state.log_history if "zero_variance_groups/extra_rounds" in entry]
    result = {"num_processes": trainer.accelerator.num_processes, "steps": trainer.state.global_step,
              "calls": [len(values) for _, values in calls], "kept": kept, "logs": logs}
    (options.out / f"rank{trainer.accelerator.process_index}.json").write_text(json.dumps(result))
    leave_cleanly()


if __name__ == "__main__":
    main()
