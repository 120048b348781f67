"""Learning per step: `grpo_trainer.GRPOTrainer` against `trl.GRPOTrainer` on the demo's toy task.

`bench_vs_trl.py` times steps; this script checks that the speed costs nothing in learning. Both trainers get
the same randomly initialised ~80k-parameter model, the same "copy 3 digits" prompts and reward
(`grpo_trainer.cli.toy`), and the demo's settings (`grpo_trainer.cli.command.DEMO`: 128 completions per step, G=16,
3 new tokens, lr 1e-3 constant, beta 0.001), one torch thread, for each seed. Each run is its own subprocess. The two
libraries draw samples from different random streams, so curves differ by sampling noise; several seeds show
how large that noise is.

Printed per seed: the mean reward over the first and the last 10% of steps, the first step whose 10-step mean
reward reaches 0.5 and 0.8, and CPU seconds per step; then the means over seeds, and one JSON object last.

    PYTHONPATH=. python benchmarks/learning_vs_trl.py                # 300 steps, seeds 0 and 1
    PYTHONPATH=. python benchmarks/learning_vs_trl.py --steps 600 --seeds 0,1,2
    PYTHONPATH=. python benchmarks/learning_vs_trl.py --checkpointing  # activation checkpointing in both
    PYTHONPATH=. python benchmarks/learning_vs_trl.py --checkpointing --impls ours,ours_noreplay

`ours_noreplay` is ours with nothing kept for `replay` (`REPLAY_MAX_BYTES = 0`): with the same seed it samples
the same first rollout as `ours`, so the two differ only by replay's rounding until their samples diverge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.5, 0.8)
IMPLS = ("ours", "trl", "ours_noreplay")


def _child(impl: str, steps: int, seed: int, checkpointing: bool = False) -> dict:
    import torch

    torch.set_num_threads(1)
    from grpo_trainer.cli.command import DEMO
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model, make_tokenizer

    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo_trainer import GRPOConfig, GRPOTrainer
        from grpo_trainer.rollout import capture

        if impl == "ours_noreplay":
            capture.REPLAY_MAX_BYTES = 0
    shared = {k: DEMO[k] for k in ("learning_rate", "lr_scheduler_type", "per_device_train_batch_size",
                                   "num_generations", "max_completion_length", "beta")}
    with tempfile.TemporaryDirectory() as output_dir:
        # Both trainers get the model as a saved directory: TRL builds its reference model from the policy's
        # `name_or_path`, which an in-memory model does not have.
        tokenizer = make_tokenizer()
        model_dir = os.path.join(output_dir, "model")
        make_tiny_model(tokenizer, seed=seed).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        args = GRPOConfig(output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none",
                          save_strategy="no", disable_tqdm=True, seed=seed,
                          gradient_checkpointing=checkpointing,
                          bf16=False, **shared)
        trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args, processing_class=tokenizer,
                              train_dataset=copy_digits_dataset(num_prompts=512, seed=seed))
        start = time.process_time()
        trainer.train()
        cpu = time.process_time() - start
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {"rewards": rewards, "cpu_s_per_step": cpu / steps}


def _first_step_reaching(rewards: list[float], level: float, window: int = 10) -> int | None:
    for end in range(window, len(rewards) + 1):
        if statistics.mean(rewards[end - window:end]) >= level:
            return end
    return None


def summarise(rewards: list[float]) -> dict:
    tenth = max(1, len(rewards) // 10)
    out = {"reward_first_10pct": statistics.mean(rewards[:tenth]),
           "reward_last_10pct": statistics.mean(rewards[-tenth:])}
    for level in THRESHOLDS:
        out[f"step_reaching_{level}"] = _first_step_reaching(rewards, level)
    return out


def run_child(impl: str, steps: int, seed: int, timeout: int, checkpointing: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--child", impl, "--steps", str(steps), "--seeds", str(seed)]
    command += ["--checkpointing"] if checkpointing else []
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} seed {seed} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1", help="Comma list of seeds (model init, data and sampling).")
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds per child run.")
    parser.add_argument("--checkpointing", action="store_true",
                        help="Activation checkpointing on in both (ours then replays the rollout's layer outputs).")
    parser.add_argument("--impls", default="ours,trl", help="Comma list of: " + ",".join(IMPLS))
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    seeds = [int(s) for s in opts.seeds.split(",") if s]
    impls = [i for i in opts.impls.split(",") if i]
    if unknown := sorted(set(impls) - set(IMPLS)):
        parser.error(f"--impls: unknown {unknown}; choose from {list(IMPLS)}")
    if opts.child:
        print("RESULT " + json.dumps(_child(opts.child, opts.steps, seeds[0], opts.checkpointing)), flush=True)
        return

    rows = []
    print(f"{'seed':>4} {'impl':<13} {'reward first 10%':>16} {'last 10%':>9} {'step to 0.5':>11} "
          f"{'step to 0.8':>11} {'CPU s/step':>10}")
    for seed in seeds:
        for impl in impls:
            result = run_child(impl, opts.steps, seed, opts.timeout, opts.checkpointing)
            row = {"seed": seed, "impl": impl, **summarise(result["rewards"]),
                   "cpu_s_per_step": result["cpu_s_per_step"], "rewards": result["rewards"]}
            rows.append(row)
            print(f"{seed:>4} {impl:<13} {row['reward_first_10pct']:>16.3f} {row['reward_last_10pct']:>9.3f} "
                  f"{str(row['step_reaching_0.5']):>11} {str(row['step_reaching_0.8']):>11} "
                  f"{row['cpu_s_per_step']:>10.4f}", flush=True)
    means = {}
    for impl in impls:
        mine = [r for r in rows if r["impl"] == impl]
        means[impl] = {key: statistics.mean(r[key] for r in mine)
                       for key in ("reward_first_10pct", "reward_last_10pct", "cpu_s_per_step")}
        print(f"mean {impl:<13} {means[impl]['reward_first_10pct']:>16.3f} {means[impl]['reward_last_10pct']:>9.3f} "
              f"{'':>11} {'':>11} {means[impl]['cpu_s_per_step']:>10.4f}")
    command = " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    print(json.dumps({"command": command, "steps": opts.steps, "means": means, "rows": rows}))


if __name__ == "__main__":
    main()
