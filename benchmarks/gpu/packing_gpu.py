"""Padding-free log-prob forwards on one CUDA GPU: packed against padded, bf16, at the Qwen2.5-0.5B shape.

Part 1, the training forward + backward alone. A micro-batch of `--batch` sequences (prompts of 20-80 tokens,
completions log-normal around `--median` with `--sigma`, in [16, T]) through the policy's log-prob forward and
backward as the trainer runs it (activation checkpointing, bf16 autocast over float32 weights, the chunked LM head):
padded (`modeling.logprobs.completion_logprobs`) and packed (`modeling.forwards.packed_logprobs`, the plan of
`modeling.packing` for this model), with SDPA and, when the `flash_attn` package is importable, flash-attention 2
(padded: its unpadding path; packed: varlen `cu_seq_lens`). Per case: padding / filler fractions, median CUDA-synced
seconds of `--repeats` forward + backward passes, peak allocated memory, the largest and mean log-prob difference
and the relative gradient difference between the two layouts, and the once-per-model self-check's verdict (isolation
and agreement in bf16).

Part 2 (unless `--no-trainer`, and only while the time budget lasts): whole training steps with
`benchmarks/gpu/bench_gpu.py` at the same spread: ours padded, ours packed, TRL.

    PYTHONPATH=. python benchmarks/gpu/packing_gpu.py --json-out benchmarks/results/packing_gpu_<date>.json

Without a CUDA device it prints why and exits 0 with a JSON object saying it was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _batch(tokenizer_vocab: int, opts: argparse.Namespace, device):
    """`[B, S+T]` ids and mask: prompts of 20-80 real tokens left-padded, completions of seeded log-normal lengths
    right-padded (token ids drawn at random, away from the special tokens)."""
    import torch

    generator = torch.Generator().manual_seed(opts.seed)
    B, T = opts.batch, opts.length
    prompts = torch.randint(20, 81, (B,), generator=generator)
    completions = torch.tensor([max(16, min(T, round(math.exp(math.log(opts.median) + opts.sigma * float(z)))))
                                for z in torch.randn(B, generator=generator)])
    S = int(prompts.max())
    T = int(completions.max())  # trimmed, as the trainer's micro-batches are
    columns = torch.arange(S + T)
    mask = ((columns >= S - prompts[:, None]) & (columns < S + completions[:, None])).long()
    ids = torch.randint(1000, tokenizer_vocab - 1000, (B, S + T), generator=generator) * mask
    return ids.to(device), mask.to(device), T


def _timed(fn, repeats: int) -> tuple[float, object]:
    import torch

    out = fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def _forward_backward(model, run, weights):
    """One log-prob forward (`run()` -> LogProbs) and the backward of a loss over the completion tokens; returns the
    log-probs and a flat copy of the gradients."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = run()
    (out.logps * weights).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return out.logps.detach(), grads


def _case(model, attention: str, ids, mask, T, opts) -> dict:
    import torch

    from grpo_trainer.modeling import forwards
    from grpo_trainer.modeling.logprobs import completion_logprobs
    from grpo_trainer.modeling.packing import PackedBatch, PackingSettings

    model.set_attn_implementation(attention)
    forwards._VERDICTS.clear()
    forwards._costs.clear()
    settings = forwards.ForwardSettings(padding_free=True)
    real = mask[:, -T:].bool()
    weights = torch.randn(real.shape, device=ids.device, generator=torch.Generator(ids.device).manual_seed(1)) * real
    packed = PackedBatch.of(ids, mask, T, PackingSettings(cost=forwards.packing_cost(model)))
    row = {"attention": attention, "batch": list(ids.shape), "packed_rows": list(packed.input_ids.shape),
           "padding_fraction": 1 - int(mask.sum()) / mask.numel(),
           "filler_fraction": 1 - packed.real_tokens / packed.tokens_computed}
    for name, run in (("padded", lambda: completion_logprobs(model, ids, mask, T)),
                      ("packed", lambda: forwards.packed_logprobs(model, packed, settings))):
        torch.cuda.reset_peak_memory_stats()
        seconds, (logps, grads) = _timed(lambda run=run: _forward_backward(model, run, weights), opts.repeats)
        row[f"{name}_s"] = seconds
        row[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        row[f"{name}_logps"], row[f"{name}_grads"] = logps, grads
    difference = (row.pop("packed_logps") - row.pop("padded_logps"))[real].abs()
    packed_grads, padded_grads = row.pop("packed_grads"), row.pop("padded_grads")
    row.update(packed_over_padded=row["packed_s"] / row["padded_s"], logp_max_abs_diff=float(difference.max()),
               logp_mean_abs_diff=float(difference.mean()),
               grad_relative_diff=float((packed_grads - padded_grads).norm() / padded_grads.norm()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        row["self_check"] = forwards.self_check(model, ids, mask, settings) or "passed"
    return row


def part_one(opts: argparse.Namespace, model_dir: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_trainer.runtime import compat

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    compat.enable_checkpointing(model)
    model.train()
    ids, mask, T = _batch(model.config.vocab_size, opts, torch.device("cuda"))
    attentions = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    rows = []
    for attention in attentions:
        rows.append(_case(model, attention, ids, mask, T, opts))
        print("# " + json.dumps(rows[-1]), flush=True)
    if len(attentions) == 1:
        print("# flash_attention_2: the flash_attn package is not importable here; SDPA only", flush=True)
    return rows


def part_two(opts: argparse.Namespace, models_dir: Path, deadline: float) -> list[dict]:
    """bench_gpu.py's whole training steps at the same spread, one run at a time while time remains."""
    rows = []
    for run in ("ours/fast", "ours/packed", "trl/generate"):
        left = deadline - time.time()
        if left < 90:
            rows.append({"run": run, "skipped": "time budget spent"})
            continue
        command = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "bench_gpu.py"), "--shapes", opts.shape,
                   "--runs", run, "--lengths", str(opts.length), "--batch", str(opts.batch), "--steps", "2",
                   "--warmup", "1", "--models-dir", str(models_dir), "--timeout", str(int(left)),
                   "--length-spread", f"{opts.median:g},{opts.sigma:g}"]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left)
            result = json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]
        except (subprocess.TimeoutExpired, IndexError, KeyError, json.JSONDecodeError) as error:
            result = {"run": run, "failed": f"{type(error).__name__}: {error}"}
        rows.append(result)
        print("# " + json.dumps(result), flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=16, help="Sequences per micro-batch.")
    parser.add_argument("--length", type=int, default=512, help="max_completion_length T.")
    parser.add_argument("--median", type=float, default=128.0, help="Median completion length (log-normal).")
    parser.add_argument("--sigma", type=float, default=0.6, help="Log-space standard deviation of the lengths.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed forward + backward passes per case.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=450.0, help="Stop starting training runs after this.")
    parser.add_argument("--no-trainer", action="store_true", help="Part 1 only.")
    parser.add_argument("--tokenizer", default="auto", help="A tokenizer directory, 'auto' or 'char' (shapes.py).")
    parser.add_argument("--json-out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure (this benchmark runs on a GPU)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    started = time.time()
    from shapes import save_real_model

    with tempfile.TemporaryDirectory() as scratch:
        models_dir = Path(scratch)
        print("# " + save_real_model(opts.shape, models_dir / opts.shape, opts.tokenizer), flush=True)
        summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "forward_backward": part_one(opts, str(models_dir / opts.shape))}
        torch.cuda.empty_cache()
        if not opts.no_trainer:
            summary["training_steps"] = part_two(opts, models_dir, started + opts.budget_s)
    summary["elapsed_s"] = time.time() - started
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
