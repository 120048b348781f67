"""What verifying a draft costs at a real checkpoint's shape: one decoder forward over Q = k + 1 positions per row
against the plain loop's one-position step, at Qwen2.5-0.5B's shape (random weights: the arithmetic, not the
tokens, is measured), CPU, float32, one torch thread.

For rows N in `--rows` and positions Q in `--positions`, after a prefill that fills `--context` cache columns, the
median CPU seconds (on CUDA, `--device cuda`, wall seconds between synchronisations) of: the plain step
(`Decoder.step`, N rows, one position, with the LM head), and the verifying forward (`Decoder.verify` over N x Q
positions, with the LM head over all of them). The ratio `verify(Q) / step` is what one forward of speculation costs
in plain steps: speculation pays when a forward commits more tokens per row than that ratio
(`speculative/mean_accepted_length`). On a GPU the decode step is memory-bound (the weights are read once per forward
whatever Q is) so the ratio stays near 1 up to tens of positions; on this CPU the step is compute-bound at 0.5B, and
the ratio grows with N x Q: that is what `speculative_verify_tokens` bounds.

    PYTHONPATH=. python benchmarks/speculative_verify_cost.py
    PYTHONPATH=. python benchmarks/speculative_verify_cost.py --rows 1,8 --positions 1,2,4,8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.shapes import QWEN_SHAPES, build_real_model, load_tokenizer
from grpo_trainer.rollout.fast.decoder import Decoder


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _seconds(fn, repeats: int, device: torch.device) -> float:
    """Median CPU seconds of `fn` on CPU; on CUDA wall seconds between synchronisations."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(clock() - start)
    return statistics.median(samples)


def measure(model, rows: int, positions: list[int], context: int, repeats: int) -> dict:
    Q_max = max(positions)
    decoder = Decoder(model, rows, context + Q_max + 1)
    for cache in (*decoder.keys, *decoder.values):
        cache.normal_()  # a filled cache; the values do not change the work done
    E = decoder.embed.shape[1]
    device = decoder.embed.device
    tokens = torch.randint(100, 1000, (rows, Q_max), device=device)
    out = {"rows": rows, "context": context}

    def plain():
        cos, sin = decoder.rotation_tables(torch.full((rows, 1), context, device=device))
        mask = torch.zeros(rows, 1, 1, context + 1, device=device, dtype=decoder.embed.dtype)
        decoder.logits(decoder.step(tokens[:, 0], context, cos[:, 0], sin[:, 0], mask))

    out["step_s"] = _seconds(plain, repeats, device)
    all_rows = torch.arange(rows, device=device)
    for Q in positions:
        columns = context + torch.arange(Q, device=device)[None].expand(rows, Q)
        cos, sin = decoder.rotation_tables(columns)
        reach = torch.arange(context + Q, device=device)
        mask = torch.zeros(rows, 1, Q, context + Q, device=device, dtype=decoder.embed.dtype).masked_fill_(
            ~(reach[None, None, None, :] <= columns[:, None, :, None]), float("-inf"))

        def verify(Q=Q, columns=columns, cos=cos, sin=sin, mask=mask):
            hidden = decoder.verify(all_rows, tokens[:, :Q], columns, cos, sin, mask)
            decoder.logits(hidden.view(rows * Q, E))

        out[f"verify_Q{Q}_s"] = _seconds(verify, repeats, device)
        out[f"verify_Q{Q}_over_step"] = out[f"verify_Q{Q}_s"] / out["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(QWEN_SHAPES))
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--positions", default="1,2,3,5,9")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, _ = load_tokenizer("char")  # the vocabulary size is what matters here
    dtype = getattr(torch, args.dtype)
    model = build_real_model(args.shape, tokenizer).to(device=args.device, dtype=dtype).eval()
    positions = [int(q) for q in args.positions.split(",")]
    results = []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            result = measure(model, rows, positions, args.context, args.repeats)
            print(json.dumps(result), flush=True)
            results.append(result)
    record = {"benchmark": "speculative_verify_cost", "shape": args.shape, "dtype": args.dtype, "threads": 1,
              "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
              "context": args.context, "cpu": _cpu(), "commit": _commit(),
              "date": time.strftime("%Y-%m-%d"), "command": "PYTHONPATH=. python benchmarks/speculative_verify_cost.py "
              f"--shape {args.shape} --rows {args.rows} --positions {args.positions} --context {args.context} "
              f"--device {args.device} --dtype {args.dtype}",
              "results": results}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
