"""Asynchronous rollouts against a real vLLM server on its own core (issue 39, item 3): is the asynchronous step
close to max(generation, training)?

Set-up (the CPU stand-in for a vLLM server on its own device): `grpo-train vllm-serve` (vLLM's CPU build) pinned to
core `--server-core` with `taskset`, each trainer run its own subprocess pinned to `--trainer-core`, one torch thread
each. The model is `cli.toy`'s Qwen2 at ~10M parameters (hidden 256, 8 layers, 8 heads, a 20k-token vocabulary),
float32; 4 prompts x G = 8 = 32 completions of up to `--max-completion-length` (64) tokens per optimizer step, the
copy-digits reward, beta 0, SGD-free defaults (AdamW). Runs alternate synchronous / `async_rollouts=1` (a neighbour's
load hits both alike), `--repeats` times.

Per run, after `--warmup` steps (medians): the step's wall seconds; generation = wall seconds inside the server
client's `generate` call per step (the server's sampling time as the trainer sees it, HTTP included); in the
synchronous run, training = step - generation (rewards, scoring, loss, backward, optimizer step, weight push). The
goal: the asynchronous step <= 1.1 x max(generation, training) of the synchronous run of the same repeat.

    .venv-vllm/bin/python benchmarks/bench_async_server.py --json-out benchmarks/results/async_server_<date>.json

Needs .venv-vllm (`bash scripts/vllm_cpu_env.sh`) and 2 idle cores: on a loaded machine the pinning shares cores
with other work and the ratio means nothing (the first line prints the load average).
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
sys.path.insert(0, str(ROOT))


def _build_model(folder: Path) -> None:
    from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(extra_vocab=20_000)
    model = make_tiny_model(tokenizer, hidden_size=256, num_layers=8, num_heads=8, seed=0)
    print(f"# model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _child(opts: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(1)
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward
    from grpo_trainer.rollout.vllm.server import ServerClient

    generate_seconds: list[float] = []
    original = ServerClient.generate

    def timed(self, *args, **kwargs):  # measures the real call, changes nothing it does
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            generate_seconds.append(time.perf_counter() - started)

    ServerClient.generate = timed

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[tuple[float, float]] = []  # (wall seconds, seconds in generate) per optimizer step
            self.started, self.generated = 0.0, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.generated = time.perf_counter(), sum(generate_seconds)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append((time.perf_counter() - self.started, sum(generate_seconds) - self.generated))

    model = AutoModelForCausalLM.from_pretrained(opts.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(opts.model_dir)
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(output_dir=output_dir, max_steps=opts.steps, logging_steps=1, report_to="none",
                          save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True, use_vllm=True,
                          vllm_mode="server", vllm_server_base_url=opts.url, per_device_train_batch_size=32,
                          num_generations=8, max_completion_length=opts.max_completion_length, beta=0.0,
                          learning_rate=1e-5, async_rollouts=opts.async_rollouts, activation_checkpointing=False)
        clock = Clock()
        trainer = GRPOTrainer(model, copy_digits_reward, args=args, processing_class=tokenizer, callbacks=[clock],
                              train_dataset=copy_digits_dataset(num_prompts=512, seed=0))
        trainer.train()
    measured = clock.steps[opts.warmup:]
    history = [row for row in trainer.state.log_history if "reward" in row]
    lengths = [row["completions/mean_length"] for row in history if "completions/mean_length" in row]
    step = statistics.median(s for s, _ in measured)
    # In an asynchronous run the generate calls of a step belong to the round sampled ahead, overlapping training.
    generation = statistics.median(g for _, g in measured)
    return {"step_s": step, "generate_s": generation, "train_s": step - generation,
            "steps": clock.steps, "mean_completion_length": statistics.mean(lengths) if lengths else None,
            **{key: statistics.mean(row[key] for row in history[opts.warmup:] if key in row)
               for key in ("async/trainer_wait_s", "async/producer_wait_s")
               if any(key in row for row in history)}}


def _run_child(opts: argparse.Namespace, url: str, model_dir: Path, async_rollouts: int) -> dict:
    argv = ["taskset", "-c", str(opts.trainer_core), sys.executable, __file__, "--child", "--url", url,
            "--model-dir", str(model_dir), "--async-rollouts", str(async_rollouts), "--steps", str(opts.steps),
            "--warmup", str(opts.warmup), "--max-completion-length", str(opts.max_completion_length)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=opts.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"failed": True, "stderr_tail": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--async-rollouts", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print("RESULT " + json.dumps(_child(opts)), flush=True)
        return
    from tests.vllm_integration.vllm_helpers import served

    print(f"# load average {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir, log = Path(folder) / "model", Path(folder) / "server.log"
        _build_model(model_dir)
        launcher = ("taskset", "-c", str(opts.server_core))
        with served(model_dir, log, launcher=launcher, kv_cache_gib="0.5") as url:
            for repeat in range(opts.repeats):
                for k in (0, 1):
                    result = _run_child(opts, url, model_dir, k)
                    rows.append({"async_rollouts": k, "repeat": repeat, **result})
                    print(f"# async={k} repeat {repeat}: step {result.get('step_s', 'FAILED')} s, generate "
                          f"{result.get('generate_s')} s, train {result.get('train_s')} s", flush=True)
    for repeat in range(opts.repeats):
        sync, asynchronous = (next(r for r in rows if r["repeat"] == repeat and r["async_rollouts"] == k)
                              for k in (0, 1))
        if sync.get("failed") or asynchronous.get("failed"):
            continue
        bound = max(sync["generate_s"], sync["train_s"])
        asynchronous["vs_sync"] = asynchronous["step_s"] / sync["step_s"]
        asynchronous["vs_max_generation_training"] = asynchronous["step_s"] / bound
        print(f"# repeat {repeat}: async / sync {asynchronous['vs_sync']:.2f}x, async / max(generation, training) "
              f"{asynchronous['vs_max_generation_training']:.2f}x", flush=True)
    summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
               "load_average_at_start": os.getloadavg(), "rows": rows}
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
