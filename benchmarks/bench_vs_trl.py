"""Side-by-side benchmark: `grpo_trainer.GRPOTrainer` against `trl.GRPOTrainer` on the same machine.

Both trainers get the same saved tiny model, the same tokenizer, the same dataset, reward, seed and config
(`num_generations` 4, 8 completions per step, identical learning rate, loss type, gradient checkpointing, and
`bf16=False`, which TRL needs explicitly on CPU). Every run is its own subprocess, so peak RSS is per run and
neither library's imports or caches leak into the other's numbers; runs alternate ours / TRL per configuration
so both see the same machine load.

Per configuration it prints median seconds per step after warm-up (CPU seconds from `time.process_time` and
wall seconds; on a shared machine CPU seconds are the steadier number), completion tokens per second, peak RSS
(`VmHWM` of the child), the reward at the start and end of the run, and the ours / TRL ratios; then where each
step's time goes (both trainers' stages wrapped with timers inside the child). The last line of stdout is one JSON
object.

    PYTHONPATH=. python benchmarks/bench_vs_trl.py --quick
    PYTHONPATH=. python benchmarks/bench_vs_trl.py                      # the full grid (long)
    PYTHONPATH=. python benchmarks/bench_vs_trl.py --sizes large --lengths 256 --betas 0.04 --peft full
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (vocabulary size, hidden size, layers, attention heads)
MODEL_SIZES: dict[str, tuple[int, int, int, int]] = {
    "small": (2048, 128, 4, 4),  # ~0.85M parameters, 2k vocabulary
    "large": (32000, 512, 2, 8),  # ~21M parameters (16M of them the tied 32k embedding)
}
PHASES = ("generation", "reference_forward", "policy_forward", "backward", "rewards")


@dataclass(frozen=True)
class Case:
    size: str
    max_completion_length: int
    beta: float
    peft: str  # "full" or "lora"
    threads: int

    @property
    def name(self) -> str:
        return f"{self.size}/T{self.max_completion_length}/beta{self.beta:g}/{self.peft}/{self.threads}t"


# ------------------------------------------------------------------------------------------------ child side


def _child(impl: str, case: Case, model_dir: str, steps: int, warmup: int, learning_rate: float, seed: int) -> dict:
    """One training run; returns its measurements. Runs inside its own process."""
    import torch

    torch.set_num_threads(case.threads)
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward

    if impl == "ours":
        from grpo_trainer import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    rss_after_import = _peak_rss_mb()

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.cpu: list[float] = []
            self.wall: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._cpu, self._wall = time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.cpu.append(time.process_time() - self._cpu)
            self.wall.append(time.perf_counter() - self._wall)

    peft_config = None
    if case.peft == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=case.max_completion_length, beta=case.beta, learning_rate=learning_rate,
            loss_type="dapo", scale_rewards="group", gradient_checkpointing=True, bf16=False,
            max_steps=warmup + steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
            seed=seed, dataloader_num_workers=0, temperature=1.0,
        )
        clock = StepClock()
        trainer = GRPOTrainer(model_dir, copy_digits_reward, args=args,
                              train_dataset=copy_digits_dataset(num_prompts=64, seed=seed),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config,
                              callbacks=[clock])
        phases = _instrument_ours(trainer) if impl == "ours" else _instrument_trl(trainer)
        trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    lengths = [row["completions/mean_length"] for row in history]
    measured = slice(warmup, None)
    cpu, wall = statistics.median(clock.cpu[measured]), statistics.median(clock.wall[measured])
    tokens = 8 * statistics.mean(lengths[measured])  # completion tokens per step
    result = {
        "impl": impl, "case": asdict(case), "cpu_s_per_step": cpu, "wall_s_per_step": wall,
        "tokens_per_step": tokens, "tokens_per_cpu_s": tokens / cpu, "tokens_per_wall_s": tokens / wall,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_import_mb": rss_after_import, "rewards": [row["reward"] for row in history],
        "step_cpu_s": clock.cpu, "step_wall_s": clock.wall,
    }
    steps_timed = len(clock.cpu)
    result["phases_cpu_s_per_step"] = {k: v / steps_timed for k, v in phases.items()}
    result["step_cpu_s_mean"] = sum(clock.cpu) / steps_timed
    return result


def _peak_rss_mb() -> float:
    """This process's peak resident set size. Linux keeps `ru_maxrss` across fork + exec, so a child would report
    the benchmark driver's peak if that were higher; `VmHWM` belongs to the process's own address space."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn, phase, totals, phase_fn=None):
    """`fn` with its CPU seconds added to `totals[phase]` (or to `totals[phase_fn()]`, decided at call time)."""
    def wrapper(*args, **kwargs):
        name = phase_fn() if phase_fn else phase
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.process_time() - start
    return wrapper


def _instrument_ours(trainer) -> dict[str, float]:
    """Wrap our trainer's stages with CPU-time accumulators (whole run, warm-up included)."""
    from grpo_trainer.trainer import grpo_trainer as trainer_module

    totals = dict.fromkeys(PHASES, 0.0)
    trainer._rollout = _timed(trainer._rollout, "generation", totals)
    trainer._micro_batch = _timed(trainer._micro_batch, "reference_forward", totals)
    trainer.compute_loss = _timed(trainer.compute_loss, "policy_forward", totals)
    trainer.accelerator.backward = _timed(trainer.accelerator.backward, "backward", totals)
    trainer_module.rewards.score_completions = _timed(trainer_module.rewards.score_completions, "rewards", totals)
    return totals


def _instrument_trl(trainer) -> dict[str, float]:
    """The same stages in TRL 1.16: its transformers generation, its log-prob helper (reference when called
    without gradients, policy with them), backward and rewards."""
    import torch

    totals = dict.fromkeys(PHASES, 0.0)
    which = lambda: "policy_forward" if torch.is_grad_enabled() else "reference_forward"  # noqa: E731
    trainer._generate_single_turn = _timed(trainer._generate_single_turn, "generation", totals)
    trainer._get_per_token_logps_and_entropies = _timed(trainer._get_per_token_logps_and_entropies, None, totals,
                                                        which)
    trainer.accelerator.backward = _timed(trainer.accelerator.backward, "backward", totals)
    trainer._calculate_rewards = _timed(trainer._calculate_rewards, "rewards", totals)
    return totals


# ----------------------------------------------------------------------------------------------- parent side


def build_models(directory: Path, sizes: list[str]) -> dict[str, str]:
    """Save one tiny model + tokenizer per size (offline, seeded); returns size -> path."""
    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

    paths = {}
    for size in sizes:
        vocab, hidden, layers, heads = MODEL_SIZES[size]
        base = len(make_tokenizer())
        tokenizer = make_tokenizer(extra_vocab=vocab - base)
        model = make_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
        path = directory / size
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[size] = str(path)
        print(f"# model {size}: vocab {len(tokenizer)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"parameters, saved to {path}", flush=True)
    return paths


def run_child(impl: str, case: Case, model_dir: str, opts: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(case.threads), "MKL_NUM_THREADS": str(case.threads),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_DISABLED": "true", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, __file__, "--child", impl, "--case", json.dumps(asdict(case)), "--model-dir",
               model_dir, "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--learning-rate",
               str(opts.learning_rate), "--seed", str(opts.seed)]
    proc = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=opts.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {case.name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(case: Case, ours: list[dict], trl: list[dict]) -> dict:
    def med(runs, key):
        return statistics.median(r[key] for r in runs)

    row = {"case": case.name, **asdict(case)}
    for impl, runs in (("ours", ours), ("trl", trl)):
        for key in ("cpu_s_per_step", "wall_s_per_step", "tokens_per_cpu_s", "peak_rss_mb", "rss_after_import_mb",
                    "tokens_per_step"):
            row[f"{impl}_{key}"] = med(runs, key)
        row[f"{impl}_cpu_s_per_step_runs"] = [r["cpu_s_per_step"] for r in runs]  # each repeat's, for the spread
        rewards = [r for run in runs for r in run["rewards"]]
        row[f"{impl}_mean_reward"] = statistics.mean(rewards)
        quarter = max(1, len(runs[0]["rewards"]) // 4)  # learning: first vs last quarter of the steps
        row[f"{impl}_reward_start"] = statistics.mean(r for run in runs for r in run["rewards"][:quarter])
        row[f"{impl}_reward_end"] = statistics.mean(r for run in runs for r in run["rewards"][-quarter:])
        row[f"{impl}_rewards"] = runs[0]["rewards"]
    row["cpu_ratio"] = row["ours_cpu_s_per_step"] / row["trl_cpu_s_per_step"]
    row["wall_ratio"] = row["ours_wall_s_per_step"] / row["trl_wall_s_per_step"]
    row["rss_ratio"] = row["ours_peak_rss_mb"] / row["trl_peak_rss_mb"]
    for impl, runs in (("ours", ours), ("trl", trl)):
        row[f"{impl}_phases_cpu_s_per_step"] = runs[0]["phases_cpu_s_per_step"]
        row[f"{impl}_step_cpu_s_mean"] = runs[0]["step_cpu_s_mean"]
    return row


def print_table(rows: list[dict]) -> None:
    header = (f"{'configuration':<30} {'ours s/step':>12} {'TRL s/step':>11} {'cpu ratio':>9} {'wall ratio':>10} "
              f"{'ours tok/s':>10} {'TRL tok/s':>9} {'ours RSS':>9} {'TRL RSS':>8} {'RSS ratio':>9} "
              f"{'ours reward start->end':>22} {'TRL reward start->end':>22}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<30} {r['ours_cpu_s_per_step']:>12.3f} {r['trl_cpu_s_per_step']:>11.3f} "
              f"{r['cpu_ratio']:>9.2f} {r['wall_ratio']:>10.2f} {r['ours_tokens_per_cpu_s']:>10.0f} "
              f"{r['trl_tokens_per_cpu_s']:>9.0f} {r['ours_peak_rss_mb']:>8.0f}M {r['trl_peak_rss_mb']:>7.0f}M "
              f"{r['rss_ratio']:>9.2f} {r['ours_reward_start']:>10.3f}->{r['ours_reward_end']:<10.3f} "
              f"{r['trl_reward_start']:>10.3f}->{r['trl_reward_end']:<10.3f}")
    print("\nWhere a step's CPU time goes (mean over all steps, warm-up included):")
    print(f"{'configuration':<30} {'impl':<5} {'step':>7} " + " ".join(f"{p:>17}" for p in (*PHASES, "rest")))
    for r in rows:
        for impl in ("ours", "trl"):
            phases, total = r[f"{impl}_phases_cpu_s_per_step"], r[f"{impl}_step_cpu_s_mean"]
            rest = total - sum(phases.values())
            cells = [f"{v:6.3f}s {100 * v / total:5.1f}%" for v in (*phases.values(), rest)]
            print(f"{r['case']:<30} {impl:<5} {total:6.3f}s " + " ".join(f"{c:>17}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Small model, T=64, beta 0.04, full FT, 1 thread.")
    parser.add_argument("--sizes", default="small,large", help="Comma list of: " + ",".join(MODEL_SIZES))
    parser.add_argument("--lengths", default="64,256", help="max_completion_length values.")
    parser.add_argument("--betas", default="0.04,0", help="KL coefficients.")
    parser.add_argument("--peft", default="full,lora", help="full and/or lora.")
    parser.add_argument("--threads", default="1,2", help="torch threads per run.")
    parser.add_argument("--steps", type=int, default=8, help="Measured steps per run (after warm-up).")
    parser.add_argument("--warmup", type=int, default=2, help="Steps left out of the medians.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per implementation per configuration.")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds per child run.")
    parser.add_argument("--json-out", default=None, help="Also write the final JSON to this file.")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.sizes, opts.lengths, opts.betas, opts.peft, opts.threads = "small", "64", "0.04", "full", "1"
        opts.steps, opts.warmup = min(opts.steps, 6), min(opts.warmup, 2)
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.child:
        result = _child(opts.child, Case(**json.loads(opts.case)), opts.model_dir, opts.steps, opts.warmup,
                        opts.learning_rate, opts.seed)
        print("RESULT " + json.dumps(result), flush=True)
        return
    def split(text: str, kind: type) -> list:
        return [kind(x) for x in text.split(",") if x]

    sizes = split(opts.sizes, str)
    cases = [Case(*c) for c in itertools.product(sizes, split(opts.lengths, int), split(opts.betas, float),
                                                  split(opts.peft, str), split(opts.threads, int))]
    print(f"# {len(cases)} configurations x {opts.repeats} repeat(s) x 2 implementations; "
          f"{opts.warmup} warm-up + {opts.steps} measured steps each", flush=True)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        paths = build_models(Path(directory), sizes)
        for case in cases:
            runs: dict[str, list[dict]] = {"ours": [], "trl": []}
            for repeat in range(opts.repeats):
                order = ("ours", "trl") if repeat % 2 == 0 else ("trl", "ours")  # alternate who goes first
                for impl in order:
                    runs[impl].append(run_child(impl, case, paths[case.size], opts))
            row = summarise(case, runs["ours"], runs["trl"])
            rows.append(row)
            print(f"# {case.name}: ours {row['ours_cpu_s_per_step']:.3f} s/step, TRL {row['trl_cpu_s_per_step']:.3f}"
                  f" s/step (CPU ratio {row['cpu_ratio']:.2f}), RSS ratio {row['rss_ratio']:.2f}", flush=True)
    print()
    print_table(rows)
    summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
               "elapsed_s": time.time() - started, "max_cpu_ratio": max(r["cpu_ratio"] for r in rows),
               "max_wall_ratio": max(r["wall_ratio"] for r in rows), "rows": rows}
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
