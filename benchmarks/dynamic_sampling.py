"""Dynamic sampling (`zero_variance_groups='resample'`) against TRL's behaviour (`'train'`) where many groups saturate.

The task is a variant of the demo's ("copy the digits", partial credit per digit, `grpo_trainer.cli.toy`) with
`--digits` digits (2 by default: a tiny model gets most of them right, so most groups saturate), late in training: a
randomly initialised ~80k-parameter model is first trained for `--warmup` steps (mode 'train'), until many prompts
get the same reward from every one of their G samples, so their groups have equal rewards. From that one saved
model, each mode trains `--steps` more steps per seed, one subprocess per run, one torch thread. Settings: 8 prompts
x G = 8 completions per step, `--digits` new tokens, lr 1e-3 constant, beta 0.

Printed per mode (means over seeds): the share of zero-variance groups in the step's own round at the start, the
mean reward (over every completion sampled at that step) over the first and last 20% of the steps, the reward
after the same number of generated completion tokens (the 'train' run's total), the extra generation rounds and
prompts per step; then one JSON object with every run's per-step curve. Learning curves, not CPU timings: they can
run while the machine is shared.

    PYTHONPATH=. python benchmarks/dynamic_sampling.py                       # warmup 300, 150 steps, seeds 0,1,2
    PYTHONPATH=. python benchmarks/dynamic_sampling.py --steps 100 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("train", "resample")
SETTINGS = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "per_device_train_batch_size": 64,
            "num_generations": 8, "max_completion_length": 3, "beta": 0.0, "logging_steps": 1,
            "activation_checkpointing": False, "report_to": "none", "save_strategy": "no", "disable_tqdm": True}


def _train(mode: str, steps: int, seed: int, model_dir: str, save_to: str | None, digits: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tokenizer

    tokenizer = make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, max_steps=steps, seed=seed, zero_variance_groups=mode,
                          **{**SETTINGS, "max_completion_length": digits})
        trainer = GRPOTrainer(model, copy_digits_reward, args=args,
                              train_dataset=copy_digits_dataset(num_prompts=2000, num_digits=digits, seed=seed),
                              processing_class=tokenizer)
        trainer.train()
        if save_to:
            trainer.save_model(save_to)
    rows = []
    G = SETTINGS["num_generations"]
    for entry in trainer.state.log_history:
        if "reward" not in entry:
            continue
        prompts = entry.get("zero_variance_groups/prompts_generated", SETTINGS["per_device_train_batch_size"] // G)
        rows.append({"step": entry["step"], "reward": entry["reward"],
                     "zero_std": entry["frac_reward_zero_std"],
                     "tokens": entry["completions/mean_length"] * prompts * G,
                     "extra_rounds": entry.get("zero_variance_groups/extra_rounds", 0.0), "prompts": prompts})
    return rows


def _run(mode: str, steps: int, seed: int, model_dir: str, digits: int, save_to: str | None = None) -> list[dict]:
    command = [sys.executable, __file__, "--child", mode, "--steps", str(steps), "--seeds", str(seed),
               "--model", model_dir, "--digits", str(digits)] + (["--save", save_to] if save_to else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mean(rows: list[dict], key: str, start: float, stop: float) -> float:
    part = rows[int(start * len(rows)):max(int(stop * len(rows)), int(start * len(rows)) + 1)]
    return statistics.fmean(r[key] for r in part)


def _reward_at_tokens(rows: list[dict], budget: float) -> float:
    """The mean reward of the last 10 steps before `budget` generated completion tokens are spent."""
    spent, kept = 0.0, []
    for row in rows:
        spent += row["tokens"]
        if spent > budget:
            break
        kept.append(row["reward"])
    return statistics.fmean(kept[-10:]) if kept else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--model")
    parser.add_argument("--save")
    parser.add_argument("--digits", type=int, default=2, help="digits to copy (the demo copies 3)")
    options = parser.parse_args()
    seeds = [int(s) for s in options.seeds.split(",")]
    if options.child:
        print(json.dumps(_train(options.child, options.steps, seeds[0], options.model, options.save,
                                options.digits)))
        return
    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        start, warm = os.path.join(folder, "start"), os.path.join(folder, "warm")
        make_tiny_model(make_tokenizer(), seed=0).save_pretrained(start)
        warmup = _run("train", options.warmup, 0, start, options.digits, save_to=warm)
        tail = 1 - 20 / len(warmup)
        reward, share = _mean(warmup, "reward", tail, 1.0), _mean(warmup, "zero_std", tail, 1.0)
        print(f"warm-up: {options.warmup} steps of 'train', over its last 20 steps: reward {reward:.3f}, "
              f"zero-variance share {share:.2f}")
        runs = {mode: {seed: _run(mode, options.steps, seed, warm, options.digits) for seed in seeds}
                for mode in MODES}
    budget = statistics.fmean(sum(r["tokens"] for r in rows) for rows in runs["train"].values())
    print(f"{'mode':10} {'zero-var share (first 20%)':>27} {'reward first 20%':>17} {'reward last 20%':>16} "
          f"{'reward at train tokens':>23} {'extra rounds/step':>18} {'prompts/step':>13} {'tokens':>8}")
    summary = {}
    for mode in MODES:
        curves = list(runs[mode].values())
        row = {"zero_std_first": statistics.fmean(_mean(c, "zero_std", 0, 0.2) for c in curves),
               "reward_first": statistics.fmean(_mean(c, "reward", 0, 0.2) for c in curves),
               "reward_last": statistics.fmean(_mean(c, "reward", 0.8, 1.0) for c in curves),
               "reward_at_budget": statistics.fmean(_reward_at_tokens(c, budget) for c in curves),
               "extra_rounds": statistics.fmean(_mean(c, "extra_rounds", 0, 1.0) for c in curves),
               "prompts": statistics.fmean(_mean(c, "prompts", 0, 1.0) for c in curves),
               "tokens": statistics.fmean(sum(r["tokens"] for r in c) for c in curves)}
        summary[mode] = row
        print(f"{mode:10} {row['zero_std_first']:27.2f} {row['reward_first']:17.3f} {row['reward_last']:16.3f} "
              f"{row['reward_at_budget']:23.3f} {row['extra_rounds']:18.2f} {row['prompts']:13.1f} "
              f"{row['tokens']:8.0f}")
    print(json.dumps({"settings": {**SETTINGS, "max_completion_length": options.digits, "digits": options.digits,
                                   "warmup": options.warmup, "steps": options.steps, "seeds": seeds},
                      "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
