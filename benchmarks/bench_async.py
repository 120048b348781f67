"""Asynchronous rollouts (`async_rollouts`) against synchronous training, in one invocation, runs alternating.

Scenarios (issue 34's benchmark list; each run is its own subprocess, one torch thread unless said):

    io        in-process, an I/O-bound reward (a judge or sandbox call: `--sleep` seconds per round, sleeping): the
              demo's toy task and settings. Async hides the wait behind the next step's training.
    compute   in-process, compute-bound: Qwen2.5-0.5B's shape on 2 of its 24 layers (`shapes.py`: real widths and
              152k vocabulary), fp32, 8 x 64 tokens, both threads of work on this machine's cores. Little or no gain
              is expected: generation and training compete for the same cores.
    learning  learning per optimizer step and per second: the demo task (copy 3 digits) and a second one (reverse 3
              digits), sync vs async 1 with each correction ('recompute', 'behaviour'), several seeds.

Per run: wall seconds per step (median after warm-up), the async/* wait metrics, rewards. The last line is one JSON
object (also `--json-out`).

    PYTHONPATH=. python benchmarks/bench_async.py --scenarios io,compute --repeats 2
    PYTHONPATH=. python benchmarks/bench_async.py --scenarios io --sleep 0.2 --corrections recompute,behaviour
    PYTHONPATH=. python benchmarks/bench_async.py --scenarios compute --sync-threads 2
    PYTHONPATH=. python benchmarks/bench_async.py --scenarios learning --steps 200 --seeds 0,1
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def _reverse_dataset(num_prompts: int, seed: int):
    """'reverse 123:' -> answer '321' (the copy task's format, a different function to learn)."""
    from grpo_trainer.cli.toy import copy_digits_dataset

    rows = copy_digits_dataset(num_prompts=num_prompts, seed=seed)
    return rows.map(lambda row: {"prompt": row["prompt"].replace("copy", "reverse"), "answer": row["answer"][::-1]})


def _child(opts: argparse.Namespace) -> dict:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(opts.threads)
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.command import DEMO
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model, make_tokenizer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    def judged(completions, **kwargs):  # the I/O-bound reward: a remote judge answering after `sleep` s
        time.sleep(opts.sleep)
        return copy_digits_reward(completions, **kwargs)

    async_settings = {"async_rollouts": opts.async_rollouts, "async_correction": opts.correction}
    with tempfile.TemporaryDirectory() as output_dir:
        if opts.scenario == "compute":
            from shapes import build_real_model, load_tokenizer

            tokenizer, _ = load_tokenizer(opts.tokenizer)
            model = build_real_model("qwen2.5-0.5b-2layers", tokenizer, seed=opts.seed)
            settings = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                            learning_rate=1e-6, beta=0.0)
            dataset, reward = copy_digits_dataset(num_prompts=256, seed=opts.seed), copy_digits_reward
        else:
            tokenizer = make_tokenizer()
            model = make_tiny_model(tokenizer, seed=opts.seed)
            settings = {k: DEMO[k] for k in ("learning_rate", "lr_scheduler_type", "per_device_train_batch_size",
                                             "num_generations", "max_completion_length", "beta")}
            task = copy_digits_dataset if opts.task == "copy" else _reverse_dataset
            dataset = task(num_prompts=512, seed=opts.seed)
            reward = judged if opts.scenario == "io" else copy_digits_reward
        args = GRPOConfig(output_dir=output_dir, max_steps=opts.steps, logging_steps=1, report_to="none",
                          save_strategy="no", seed=opts.seed, disable_tqdm=True, disable_dropout=True,
                          **settings, **async_settings)
        clock = Clock()
        trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[clock])
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
    history = [row for row in trainer.state.log_history if "reward" in row]
    measured = clock.seconds[opts.warmup:]
    waits = {key: statistics.mean(row[key] for row in history[opts.warmup:] if key in row)
             for key in ("async/trainer_wait_s", "async/producer_wait_s") if any(key in row for row in history)}
    return {"step_s": statistics.median(measured), "wall_s": wall, "rewards": [row["reward"] for row in history],
            "step_s_all": clock.seconds, **waits}


def run_child(opts: argparse.Namespace, **changes) -> dict:
    argv = [sys.executable, __file__, "--child"]
    for key, value in {**vars(opts), **changes}.items():
        if key in ("child", "json_out", "scenarios", "seeds", "repeats", "tasks", "corrections", "sync_threads") \
                or value is None:
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(changes.get("threads", opts.threads))}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=opts.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"failed": True, "stderr_tail": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def _learning_summary(rewards: list[float], wall: float) -> dict:
    tail = rewards[-max(1, len(rewards) // 5):]
    reach = next((i + 1 for i in range(len(rewards)) if statistics.mean(rewards[max(0, i - 9):i + 1]) >= 0.5), None)
    return {"final_reward": statistics.mean(tail), "step_to_0.5": reach, "reward_per_s": sum(rewards) / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="io,compute,learning")
    parser.add_argument("--scenario", default="io", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", default="copy,reverse")
    parser.add_argument("--task", default="copy", help=argparse.SUPPRESS)
    parser.add_argument("--sleep", type=float, default=1.5, help="io: seconds the judge takes per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--async-rollouts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--correction", default="recompute", help=argparse.SUPPRESS)
    parser.add_argument("--corrections", default="recompute",
                        help="io/compute: the async_correction values of the async_rollouts=1 runs, comma-separated")
    parser.add_argument("--sync-threads", default="",
                        help="io/compute: also a synchronous run at each of these torch thread counts")
    parser.add_argument("--tokenizer", default="auto")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print("RESULT " + json.dumps(_child(opts)), flush=True)
        return
    rows = []
    for scenario in opts.scenarios.split(","):
        if scenario in ("io", "compute"):
            # alternating within a repeat: a neighbour's load hits every variant alike
            variants = [(0, "recompute", 1)] + [(1, c, 1) for c in opts.corrections.split(",")] + \
                [(0, "recompute", t) for t in (int(t) for t in opts.sync_threads.split(",") if t)]
            for repeat in range(opts.repeats):
                for k, correction, threads in variants:
                    result = run_child(opts, scenario=scenario, async_rollouts=k, correction=correction,
                                       threads=threads)
                    rows.append({"scenario": scenario, "async_rollouts": k, "correction": correction,
                                 "threads": threads, "repeat": repeat, **result})
                    print(f"# {scenario} async={k} {correction} threads={threads} repeat {repeat}: "
                          f"{result.get('step_s', 'FAILED')} s/step (trainer waited "
                          f"{result.get('async/trainer_wait_s')}, producer waited "
                          f"{result.get('async/producer_wait_s')})", flush=True)
            continue
        for task in opts.tasks.split(","):
            for seed in (int(s) for s in opts.seeds.split(",")):
                for k, correction in ((0, "recompute"), (1, "recompute"), (1, "behaviour")):
                    result = run_child(opts, scenario="learning", task=task, seed=seed, async_rollouts=k,
                                       correction=correction, warmup=0)
                    summary = {} if result.get("failed") else _learning_summary(result["rewards"], result["wall_s"])
                    rows.append({"scenario": "learning", "task": task, "seed": seed, "async_rollouts": k,
                                 "correction": correction, **summary, **result})
                    print(f"# learning {task} seed {seed} async={k} {correction}: {summary}", flush=True)
    summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]), "rows": rows}
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
