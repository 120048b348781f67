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

Without a CUDA device it prints why and exits 0 with a JSON object saying it was skipped. `--device cpu` runs part 1
on the CPU instead (float32, no autocast, CPU seconds; one thread unless `--threads`), as a check of the same code
at the real shape:

    PYTHONPATH=. python benchmarks/gpu/packing_gpu.py --device cpu --batch 8 --repeats 1 --no-trainer
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


def _timed(fn, repeats: int, cuda: bool) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up: CUDA-synchronised wall seconds, or CPU seconds."""
    import torch

    out = fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter() if cuda else time.process_time()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() if cuda else time.process_time()) - started)
    return statistics.median(times), out


def _precision(cuda: bool):
    """bf16 autocast on a GPU (as the trainer's bf16=True), float32 on a CPU."""
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()


def _forward_backward(model, run, weights, cuda: bool):
    """One log-prob forward (`run()` -> LogProbs) and the backward of a loss over the completion tokens (gradients
    left in `.grad`); returns the log-probs."""
    model.zero_grad(set_to_none=True)
    with _precision(cuda):
        out = run()
    (out.logps * weights).sum().backward()
    return out.logps.detach()


def _case(model, attention: str, ids, mask, T, opts) -> dict:
    import torch

    from grpo_trainer.modeling import forwards
    from grpo_trainer.modeling.logprobs import completion_logprobs
    from grpo_trainer.modeling.packing import PackedBatch, PackingSettings

    cuda = ids.device.type == "cuda"
    model.set_attn_implementation(attention)
    forwards._VERDICTS.clear()
    forwards._costs.clear()
    settings = forwards.ForwardSettings(padding_free=True)
    real = mask[:, -T:].bool()
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(1)).to(ids.device) * real
    packed = PackedBatch.of(ids, mask, T, PackingSettings(cost=forwards.packing_cost(model)))
    row = {"attention": attention, "batch": list(ids.shape), "packed_rows": list(packed.input_ids.shape),
           "padding_fraction": 1 - int(mask.sum()) / mask.numel(),
           "filler_fraction": 1 - packed.real_tokens / packed.tokens_computed}
    logps, padded_grads = {}, None
    for name, run in (("padded", lambda: completion_logprobs(model, ids, mask, T)),
                      ("packed", lambda: forwards.packed_logprobs(model, packed, settings))):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds, logps[name] = _timed(lambda run=run: _forward_backward(model, run, weights, cuda), opts.repeats,
                                      cuda)
        row[f"{name}_s"] = seconds
        row[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        if padded_grads is None:  # one copy of the padded gradients; the packed ones are compared in place
            padded_grads = [p.grad.clone() for p in model.parameters()]
    squared = sum(float((p.grad - g).pow(2).sum()) for p, g in zip(model.parameters(), padded_grads))
    reference = sum(float(g.pow(2).sum()) for g in padded_grads)
    difference = (logps["packed"] - logps["padded"])[real].abs()
    row.update(packed_over_padded=row["packed_s"] / row["padded_s"], logp_max_abs_diff=float(difference.max()),
               logp_mean_abs_diff=float(difference.mean()), grad_relative_diff=(squared / reference) ** 0.5)
    del padded_grads
    model.zero_grad(set_to_none=True)
    with _precision(cuda):
        row["self_check"] = forwards.self_check(model, ids, mask, settings) or "passed"
    return row


def part_one(opts: argparse.Namespace, model_dir: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_trainer.runtime import compat

    device = torch.device(opts.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    compat.enable_checkpointing(model)
    model.train()
    ids, mask, T = _batch(model.config.vocab_size, opts, device)
    flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    attentions = ["sdpa"] + (["flash_attention_2"] if flash else [])
    rows = []
    for attention in attentions:
        try:
            rows.append(_case(model, attention, ids, mask, T, opts))
        except Exception as error:  # noqa: BLE001 - one attention implementation failing must not stop the others
            rows.append({"attention": attention, "failed": f"{type(error).__name__}: {error}"})
        print("# " + json.dumps(rows[-1]), flush=True)
    if device.type == "cuda" and not flash:
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
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: part 1 only, float32, CPU seconds (a check of the same code at the real shape).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads with --device cpu.")
    parser.add_argument("--json-out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure (this benchmark runs on a GPU; --device cpu runs part 1 here)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)
        opts.no_trainer = True
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    started = time.time()
    from shapes import save_real_model

    with tempfile.TemporaryDirectory() as scratch:
        models_dir = Path(scratch)
        print("# " + save_real_model(opts.shape, models_dir / opts.shape, opts.tokenizer), flush=True)
        device = torch.cuda.get_device_name(0) if opts.device == "cuda" else f"cpu ({opts.threads} threads)"
        summary = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]), "device": device,
                   "torch": torch.__version__, "forward_backward": part_one(opts, str(models_dir / opts.shape))}
        if opts.device == "cuda":
            torch.cuda.empty_cache()
        if not opts.no_trainer:
            summary["training_steps"] = part_two(opts, models_dir, started + opts.budget_s)
    summary["elapsed_s"] = time.time() - started
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
