"""Peak memory and step time as the completion length T doubles, grpo_trainer against TRL 1.16 (issue 41, item 3).

Both trainers train on identical completions of exactly T random tokens supplied through `rollout_func` (no
generation: only the training step differs), 2 rows (one prompt, `num_generations` 2), on the 2-layer proxy of
Qwen2.5-0.5B (`shapes.py`: real widths and the real 151,936-token vocabulary), float32 on CPU, 1 thread, each
trainer at its defaults (both checkpoint activations; grpo_trainer also packs rows: `padding_free`). Each run is its
own subprocess; per T the two trainers run one after the other (the order alternating with T), and a trainer stops
doubling once its peak passes `--budget-gib` or a run fails. Per run: each optimizer step's CPU seconds
(`time.process_time`) and wall seconds, resident memory after the model loaded and the run's peak (VmHWM).

    PYTHONPATH=. python benchmarks/long_completions.py --lengths 1024,2048,4096,8192 --steps 2 \
        --out benchmarks/results/long_completions_cpu_<date>.json

On a GPU (`--device cuda`: bfloat16 mixed precision, float32 weights; TRL with its fused Triton LM head, which it
uses wherever triton is installed) the peak is `torch.cuda.max_memory_allocated` and a trainer stops doubling at its
first failed run (out of memory) or past `--budget-gib`; `--shape qwen2.5-0.5b` / `qwen2.5-1.5b` for the real
depths (benchmarks/gpu/session.sh):

    PYTHONPATH=. python benchmarks/long_completions.py --device cuda --shape qwen2.5-0.5b --budget-gib 139 \
        --lengths 4096,8192,16384,32768,65536 --steps 2 --out benchmarks/results/gpu_session/long_completions.json

The output also holds grpo_trainer's memory plan for each length (what the trainer checks before loading the
weights); `--plans-only` gives the plans without training (cheap at any length).
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
TRAINERS = ("ours", "trl")


def plans(lengths: list[int], steps: int, model_dir: str, tile: int = 0, device: str = "cpu",
          recompute: bool = False) -> list[dict]:
    """grpo_trainer's memory plan for each length (`trainer.memory.plan_run`, what the trainer checks before it
    loads the weights): its predicted peak in MiB and the instant it occurs at, and its peak without the packed
    attention mask (with its allocator share): the bound for rows of mixed lengths, which rows of exactly T tokens
    (run padded and unmasked, or packed one per row) never build."""
    from fed_completions import prompts, training_args
    from transformers import AutoTokenizer

    from grpo_trainer import GRPOConfig
    from grpo_trainer.planning.estimate import CPU_ALLOCATOR_OVERHEAD
    from grpo_trainer.trainer.memory import plan_run

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    rows = []
    with tempfile.TemporaryDirectory() as output:
        for T in lengths:
            plan = plan_run(model_dir, training_args(GRPOConfig, output, T, steps, device, **_ours(tile, recompute)),
                            prompts(), tokenizer, device=device, with_device=False).plan
            mask = [sum(i.bytes[k] for i in plan.items if i.name == "packed attention mask")
                    for k in range(len(plan.totals()))]
            unmasked = max(t - m * (1 + CPU_ALLOCATOR_OVERHEAD) for t, m in zip(plan.totals(), mask, strict=True))
            rows.append({"T": T, "predicted_peak_mb": plan.peak_bytes / 2**20, "peak_at": plan.peak_instant,
                         "predicted_without_packed_mask_mb": unmasked / 2**20})
    return rows


def child(trainer_name: str, T: int, steps: int, model_dir: str, tile: int = 0, device: str = "cpu",
          recompute: bool = False) -> dict:
    import torch
    from fed_completions import (
        distinct_rewards,
        peak_rss_mb,
        prompts,
        random_completions,
        rss_mb,
        step_timer,
        training_args,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if trainer_name == "ours":
        from grpo_trainer import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # bf16 autocast on a GPU
    loaded_mb = rss_mb()
    times: list[dict] = []
    with tempfile.TemporaryDirectory() as output:
        args = training_args(GRPOConfig, output, T, steps, device, **_ours(tile, recompute))
        trainer = GRPOTrainer(model, distinct_rewards, args=args, processing_class=tokenizer, train_dataset=prompts(),
                              rollout_func=random_completions(tokenizer, model.config.vocab_size, T),
                              callbacks=[step_timer(times)])
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gpu = {"peak_gpu_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
           "peak_gpu_reserved_mb": torch.cuda.max_memory_reserved() / 2**20} if device == "cuda" else {}
    return {"trainer": trainer_name, "T": T, "device": device, "mlp_tile_tokens": tile,
            "recompute_attention": recompute, "steps": times,
            "loaded_rss_mb": loaded_mb, "peak_rss_mb": peak_rss_mb(), **gpu, "losses": losses}


def _ours(tile: int, recompute: bool) -> dict:
    """grpo_trainer's own options of this run (TRL's GRPOConfig has neither: its child gets none)."""
    return {**({"mlp_tile_tokens": tile} if tile else {}), **({"recompute_attention": True} if recompute else {})}


def run(trainer_name: str, T: int, steps: int, model_dir: str, tile: int = 0, device: str = "cpu",
        recompute: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--steps", str(steps), "--mlp-tile-tokens", str(tile),
                          "--device", device, *(["--recompute-attention"] if recompute else []),
                          "--child", trainer_name, str(T), model_dir],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        return {"trainer": trainer_name, "T": T, "error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="ours,trl (default) or one of them")
    parser.add_argument("--mlp-tile-tokens", type=int, default=0,
                        help="grpo_trainer's sequence-tiled MLP (mlp_tile_tokens; TRL has none); 0, its default: off")
    parser.add_argument("--recompute-attention", action="store_true",
                        help="grpo_trainer's recompute_attention (each attention block checkpointed; TRL has none)")
    parser.add_argument("--plans-only", action="store_true", help="only grpo_trainer's plans, no training")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bfloat16 mixed precision on the GPU; the peak is torch.cuda's allocated bytes")
    parser.add_argument("--shape", default="qwen2.5-0.5b-2layers", help="a shapes.QWEN_SHAPES name")
    parser.add_argument("--child", nargs=3, metavar=("TRAINER", "T", "MODEL_DIR"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        print(json.dumps(child(cli.child[0], int(cli.child[1]), cli.steps, cli.child[2], cli.mlp_tile_tokens,
                               cli.device, cli.recompute_attention)))
        return
    from shapes import save_real_model

    results, stopped = [], set()
    record = {"date": time.strftime("%Y-%m-%d"), "threads": 1, "budget_gib": cli.budget_gib, "device": cli.device,
              "mlp_tile_tokens": cli.mlp_tile_tokens, "recompute_attention": cli.recompute_attention,
              "results": results}
    with tempfile.TemporaryDirectory() as model_dir:
        record["model"] = save_real_model(cli.shape, Path(model_dir), "char")
        print(record["model"], flush=True)
        lengths = list(map(int, cli.lengths.split(",")))
        record["plans"] = plans(lengths, cli.steps, model_dir, cli.mlp_tile_tokens, cli.device,
                                cli.recompute_attention)
        print(json.dumps(record["plans"]), flush=True)
        if cli.plans_only:
            lengths = []
        trainers = [name for name in TRAINERS if name in cli.trainers.split(",")]
        for i, T in enumerate(lengths):
            for name in trainers[::-1] if i % 2 else trainers:
                if name in stopped:
                    continue
                result = run(name, T, cli.steps, model_dir, cli.mlp_tile_tokens, cli.device, cli.recompute_attention)
                print(json.dumps(result), flush=True)
                results.append(result)
                peak = result.get("peak_gpu_allocated_mb", result.get("peak_rss_mb", 0.0))
                if "error" in result or peak > cli.budget_gib * 1024:
                    stopped.add(name)
                _write(record, cli.out)  # after every run: a long sweep stopped early keeps what it measured
        _write(record, cli.out)


def _write(record: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
