"""First step against later steps at a long completion length: what the once-per-model self-checks cost.

Identical completions of exactly T random tokens are supplied through `rollout_func` (no generation), 2 rows
(one prompt, `num_generations` 2), on the 2-layer proxy of Qwen2.5-0.5B (`shapes.py`: real widths and the real
151,936-token vocabulary), float32 on CPU, gradient checkpointing on (the default), padding-free on (the default:
the packing self-check runs on the first micro-batch). Each run is its own subprocess; per step it records CPU
seconds (`time.process_time`, the steadier number on a shared machine) and wall seconds, and the run's peak RSS.

`--check whole` reproduces the self-check as it was before `forwards.check_slice` (every row and token of the
first micro-batch: CHECK_TOKENS set beyond any sequence); `--check slice` is the shipped bounded slice.

    PYTHONPATH=. python benchmarks/first_step.py --lengths 4096 --checks slice,whole --steps 3 \
        --out benchmarks/results/first_step_T4096_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(T: int, check: str, steps: int, model_dir: str) -> dict:
    import torch
    from fed_completions import distinct_rewards, peak_rss_mb, prompts, random_completions, step_timer, training_args
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.modeling import forwards

    if check == "whole":
        forwards.CHECK_TOKENS = 10**9  # every sequence kept whole: the check as it was before the slice
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size

    rollout_func = random_completions(tokenizer, vocab, T)
    times: list[dict] = []

    with tempfile.TemporaryDirectory() as output:
        args = training_args(GRPOConfig, output, T, steps)
        dataset = prompts()
        trainer = GRPOTrainer(model, distinct_rewards, args=args, processing_class=tokenizer, train_dataset=dataset,
                              rollout_func=rollout_func, callbacks=[step_timer(times)])
        trainer.train()
    later = times[1:]
    return {"T": T, "check": check, "steps": times, "peak_rss_mb": peak_rss_mb(),
            "first_over_later_cpu": times[0]["cpu_s"] / (sum(t["cpu_s"] for t in later) / len(later)),
            "first_over_later_wall": times[0]["wall_s"] / (sum(t["wall_s"] for t in later) / len(later)),
            "check_tokens": forwards.CHECK_TOKENS, "check_rows": forwards.CHECK_ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--checks", default="slice,whole")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=3, metavar=("T", "CHECK", "MODEL_DIR"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        print(json.dumps(child(int(cli.child[0]), cli.child[1], cli.steps, cli.child[2])))
        return
    from shapes import save_real_model

    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        description = save_real_model("qwen2.5-0.5b-2layers", Path(model_dir), "char")
        print(description, flush=True)
        for T in map(int, cli.lengths.split(",")):
            for check in cli.checks.split(","):
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
                out = subprocess.run([sys.executable, __file__, "--steps", str(cli.steps), "--child", str(T), check,
                                      model_dir], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps(result), flush=True)
                results.append(result)
    record = {"model": description, "date": time.strftime("%Y-%m-%d"), "threads": 1, "results": results}
    if cli.out:
        Path(cli.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
