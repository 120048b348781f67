"""GPU benchmark, ready for a CUDA machine: this project's trainer against TRL 1.16's at real checkpoint shapes.

Models: random weights in the public configs of Qwen2.5-0.5B and Qwen2.5-1.5B (`benchmarks/shapes.py`: the real
151,936-entry vocabulary, tied embeddings), trained in bfloat16 mixed precision (`bf16=True`) on one GPU, with a
real-size tokenizer. Runs, each in its own subprocess (so peak memory is per run), alternating between trainers:

    ours/fast        generation_backend="fast" (the default)
    ours/packed      the same with padding_free=True (packed log-prob forwards; the default)
    ours/padded      the same with padding_free=False
    ours/generate    generation_backend="generate" (transformers' model.generate)
    ours/vllm        use_vllm=True, vllm_mode="colocate" (only where vLLM is installed)
    ours/compact     GRPO_TRAINER_FAST_CUDA_DECODE=compact (the decoder, finished rows compacted out)
    ours/graphs      GRPO_TRAINER_FAST_CUDA_DECODE=graphs (that, the step as CUDA graphs per bucket)
    trl/generate     TRL's transformers generation
    trl/paged        TRL with use_transformers_paged=True (transformers' continuous batching, paged cache)
    trl/static       TRL with generation_kwargs={"cache_implementation": "static"}
    trl/vllm         TRL with use_vllm=True, vllm_mode="colocate" (only where vLLM is installed)

Per run: seconds per step (wall, CUDA-synchronised, median after warm-up), seconds of generation per step and
generated tokens per second of generation, peak GPU memory (`torch.cuda.max_memory_allocated` and `_reserved`),
and the rewards. The last line of stdout is one JSON object (also written to `--json-out`).

    PYTHONPATH=. python benchmarks/gpu/bench_gpu.py --json-out benchmarks/results/gpu_<date>.json
    PYTHONPATH=. python benchmarks/gpu/bench_gpu.py --shapes qwen2.5-0.5b --runs ours/fast,trl/generate --lengths 256

`--length-spread MEDIAN,SIGMA` ends completions with EOS at seeded log-normal lengths in [16, T] in every run alike
(`tests.toy_lengths`; a random model never samples EOS, so otherwise all completions have T tokens).

Without a CUDA device it prints why and exits with status 0 and a JSON object saying it was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

RUNS = ("ours/fast", "ours/packed", "ours/padded", "ours/generate", "ours/vllm", "ours/compact", "ours/graphs",
        "trl/generate", "trl/paged", "trl/static", "trl/vllm")


def _child(run: str, model_dir: str, length: int, beta: float, steps: int, warmup: int, batch: int,
           spread: str = "") -> dict:
    """One training run on cuda:0; returns its measurements."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward

    trainer_name, backend = run.split("/")
    if trainer_name == "ours" and backend in ("compact", "graphs"):
        os.environ["GRPO_TRAINER_FAST_CUDA_DECODE"] = backend  # read when the trainer builds its backend
    if trainer_name == "ours":
        from grpo_trainer import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer

    def sync_clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = sync_clock()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(sync_clock() - self._started)

    settings = dict(per_device_train_batch_size=batch, num_generations=4, max_completion_length=length, beta=beta,
                    learning_rate=1e-6, loss_type="dapo", bf16=True, gradient_checkpointing=True,
                    max_steps=warmup + steps, logging_steps=1, report_to="none", save_strategy="no",
                    disable_tqdm=True, seed=0, temperature=1.0, **_backend_settings(trainer_name, backend))
    clock = StepClock()
    generation: list[float] = []
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = GRPOTrainer(model_dir, copy_digits_reward, args=GRPOConfig(output_dir=output_dir, **settings),
                              train_dataset=copy_digits_dataset(num_prompts=256, seed=0),
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
        if spread:
            from tests.toy_lengths import LogNormalLengths, install_lengths

            median, sigma = (float(x) for x in spread.split(","))
            install_lengths(trainer.model, LogNormalLengths(maximum=length, median=median, sigma=sigma),
                            trainer.processing_class.pad_token_id)
        owner, name = (trainer.rounds, "rollout") if trainer_name == "ours" else (trainer, "_generate_single_turn")
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = sync_clock()
            try:
                return inner(*args, **kwargs)
            finally:
                generation.append(sync_clock() - started)

        setattr(owner, name, timed)
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
    history = [row for row in trainer.state.log_history if "reward" in row]
    measured = slice(warmup, None)
    tokens = batch * statistics.mean(row["completions/mean_length"] for row in history[measured])
    per_step_generation = sum(generation[warmup:]) / max(1, steps)  # rollouts per step may be more than one
    return {"run": run, "step_s": statistics.median(clock.seconds[measured]), "step_s_all": clock.seconds,
            "generation_s_per_step": per_step_generation, "tokens_per_step": tokens,
            "generated_tokens_per_s": tokens / per_step_generation if per_step_generation else None,
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
            "rewards": [row["reward"] for row in history], "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__}


def _backend_settings(trainer_name: str, backend: str) -> dict:
    if backend == "vllm":
        return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
    if backend in ("packed", "padded"):
        return {"generation_backend": "fast", "padding_free": backend == "packed"}
    if backend in ("compact", "graphs"):  # the child sets GRPO_TRAINER_FAST_CUDA_DECODE (fast.backend decision 6)
        return {"generation_backend": "fast"}
    if backend == "paged":
        return {"use_transformers_paged": True}
    if backend == "static":
        return {"generation_kwargs": {"cache_implementation": "static"}}
    return {"generation_backend": backend} if trainer_name == "ours" else {}


def available(run: str) -> str | None:
    """Why `run` cannot run here, or None."""
    if run.endswith("/vllm") and importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


def run_child(run: str, model_dir: str, opts: argparse.Namespace, length: int, beta: float) -> dict:
    command = [sys.executable, __file__, "--child", run, "--model-dir", model_dir, "--lengths", str(length),
               "--betas", str(beta), "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--batch",
               str(opts.batch), "--length-spread", opts.length_spread]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=opts.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"run": run, "failed": True, "returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from shapes import QWEN_SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help="Comma list of: " + ",".join(QWEN_SHAPES))
    parser.add_argument("--runs", default=",".join(RUNS), help="Comma list of: " + ",".join(RUNS))
    parser.add_argument("--lengths", default="256,1024", help="max_completion_length values.")
    parser.add_argument("--betas", default="0", help="KL coefficients.")
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions per step).")
    parser.add_argument("--steps", type=int, default=5, help="Measured steps per run.")
    parser.add_argument("--warmup", type=int, default=2, help="Steps left out of the medians.")
    parser.add_argument("--tokenizer", default="auto", help="A tokenizer directory, 'auto' or 'char' (shapes.py).")
    parser.add_argument("--models-dir", default=None, help="Keep the saved models here instead of a temporary one.")
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds per child run.")
    parser.add_argument("--length-spread", default="",
                        help="MEDIAN,SIGMA: completion lengths log-normal in [16, T] (default: all T).")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    import torch

    if opts.child:
        result = _child(opts.child, opts.model_dir, int(opts.lengths), float(opts.betas), opts.steps, opts.warmup,
                        opts.batch, opts.length_spread)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure (this benchmark runs on a GPU)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    from shapes import save_real_model

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(opts.models_dir or scratch)
        for shape in opts.shapes.split(","):
            path = directory / shape
            if not (path / "config.json").is_file():
                print("# " + save_real_model(shape, path, opts.tokenizer), flush=True)
            for length in (int(x) for x in opts.lengths.split(",")):
                for beta in (float(x) for x in opts.betas.split(",")):
                    for run in opts.runs.split(","):
                        reason = available(run)
                        result = {"run": run, "skipped": reason} if reason else run_child(run, str(path), opts,
                                                                                          length, beta)
                        rows.append({"shape": shape, "max_completion_length": length, "beta": beta, **result})
                        print(_line(rows[-1]), flush=True)
    summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]), "rows": rows}
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def _line(row: dict) -> str:
    where = f"{row['shape']} T={row['max_completion_length']} beta={row['beta']:g} {row['run']}"
    if row.get("skipped") or row.get("failed"):
        return f"# {where}: {'skipped (' + row['skipped'] + ')' if row.get('skipped') else 'FAILED'}"
    return (f"# {where}: {row['step_s']:.2f} s/step, generation {row['generation_s_per_step']:.2f} s/step "
            f"({row['generated_tokens_per_s']:.0f} tok/s), peak {row['peak_allocated_gb']:.2f} GB allocated / "
            f"{row['peak_reserved_gb']:.2f} GB reserved")


if __name__ == "__main__":
    main()
