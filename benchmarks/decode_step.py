"""The CPU decode step of a small model: what its time is made of, and whether `torch.compile` pays for it.

The rollout's decode step (`fast_decoder.Decoder.step`) is where a small model's GRPO step spends most of its time
on CPU. Two measurements, on the benchmark's small model shape (4 layers, 2k vocabulary, 8 rows, 12 prompt +
64 new tokens), one thread:

1. Widths: the same step at hidden sizes 32, 64, 128 and 256 (same operations, 1/16x to 4x the weights). The
   time at width 32 is the per-operation floor; what grows with the width is arithmetic and weight traffic.
2. Compilation fuses the elementwise work; what it saves per token and what it costs once, at width 128 (the
   benchmark's 0.85M-parameter model):

- `eager`: the step the trainer runs, over a 64-token decode loop.
- `compiled_static`: a shape-static copy of that step (attention over the whole preallocated cache with an
  additive mask, the cache column as a tensor), compiled once with `dynamic=False`: the best case for inductor.
- `compiled_dynamic` (`--dynamic`): the eager step compiled with `dynamic=True`. The attended cache length
  grows each token, so dynamo recompiles until its recompile limit and then runs eagerly (slow: minutes).

oneDNN-packed weights are opaque to the compiler, so packing is off in every variant. Compile time is wall time:
inductor runs its C++ compiler in subprocesses, which `time.process_time` of this process does not see; and it is
a cold compile (a fresh `TORCHINDUCTOR_CACHE_DIR`), as a new run on a new machine pays it.

    PYTHONPATH=. python benchmarks/decode_step.py
    PYTHONPATH=. python benchmarks/decode_step.py --dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

# A cold compile, as a fresh training run on a fresh machine pays it (inductor caches compiled kernels on disk).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer  # noqa: E402
from grpo_trainer.rollout.fast import decoder as fast_decoder  # noqa: E402

ROWS, PROMPT, NEW = 8, 12, 64
WIDTHS = (32, 64, 128, 256)


def build(hidden: int = 128) -> fast_decoder.Decoder:
    tokenizer = make_tokenizer(extra_vocab=2048 - len(make_tokenizer()))
    model = make_tiny_model(tokenizer, hidden_size=hidden, num_layers=4, num_heads=4, seed=0).eval()
    decoder = fast_decoder.Decoder(model, ROWS, PROMPT + NEW)
    for cache in decoder.keys + decoder.values:
        cache.normal_()  # a filled prompt cache; the values do not change the work done
    return decoder


def static_step(decoder: fast_decoder.Decoder):
    """The eager step's operations with shapes that do not change from token to token."""

    def step(tokens, column, cos, sin, mask):  # column: [1] long; mask: [N, 1, 1, L] additive
        N, H, K, D = tokens.shape[0], decoder.H, decoder.K, decoder.D
        hidden = decoder.embed[tokens]
        for layer, keys, values in zip(decoder.layers, decoder.keys, decoder.values):
            x = F.rms_norm(hidden, hidden.shape[-1:], *layer["norm1"])
            qkv = layer["qkv"](x).view(N, H + 2 * K, D)
            qk = qkv[:, :H + K] * cos + torch.roll(qkv[:, :H + K], D // 2, dims=-1) * sin
            keys.index_copy_(2, column, qk[:, H:].unsqueeze(2))
            values.index_copy_(2, column, qkv[:, H + K:].unsqueeze(2))
            attn = F.scaled_dot_product_attention(qk[:, :H].view(N, K, H // K, D), keys, values, attn_mask=mask,
                                                  scale=layer["scaling"])
            hidden = layer["o_add"](hidden, attn.view(N, H * D))
            x = F.rms_norm(hidden, hidden.shape[-1:], *layer["norm2"])
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            hidden = layer["down_add"](hidden, layer["act"](gate) * up)
        return decoder.logits(hidden)

    return step


def decode_loop(decoder: fast_decoder.Decoder, step, static: bool) -> None:
    """NEW decode steps (step + logits) for ROWS rows after a PROMPT-token prompt. The per-step inputs (rotary
    tables, masks, cache columns) are built before the loop, so the loop times the step alone."""
    tokens = torch.randint(0, 2000, (ROWS,), generator=torch.Generator().manual_seed(0))
    cos, sin = decoder.rotation_tables(torch.arange(PROMPT, PROMPT + NEW).expand(ROWS, NEW))  # [N, T, 1, D]
    columns = torch.arange(PROMPT, PROMPT + NEW)  # [T]
    if static:  # step t attends to cache columns <= PROMPT + t: an additive mask over the whole cache per step
        future = columns[:, None] < torch.arange(PROMPT + NEW)  # [T, L]
        masks = torch.zeros(NEW, PROMPT + NEW).masked_fill_(future, float("-inf"))[:, None, None, None, :]
        for t in range(NEW):
            step(tokens, columns[t:t + 1], cos[:, t], sin[:, t], masks[t].expand(ROWS, 1, 1, -1))
    else:
        mask = torch.zeros(ROWS, 1, 1, PROMPT + NEW)
        for t in range(NEW):
            column = PROMPT + t
            decoder.logits(step(tokens, column, cos[:, t], sin[:, t], mask[..., :column + 1]))


def us_per_token(decoder: fast_decoder.Decoder, step, static: bool) -> float:
    """CPU microseconds per token of one decode loop."""
    start = time.process_time()
    decode_loop(decoder, step, static)
    return (time.process_time() - start) / NEW * 1e6


def measure_widths(repeats: int) -> dict[str, float]:
    """Eager per-token time of the step at each width, in interleaved rounds (same machine load for all)."""
    with torch.inference_mode():
        by_width = {hidden: build(hidden) for hidden in WIDTHS}
        samples: dict[int, list[float]] = {hidden: [] for hidden in WIDTHS}
        for _ in range(repeats):  # one loop per width per round: the rounds interleave the widths finely
            for hidden, dec in by_width.items():
                samples[hidden].append(us_per_token(dec, dec.step, False))
    return {f"eager_width{hidden}_us_per_token": statistics.median(values) for hidden, values in samples.items()}


def measure_compile(repeats: int, dynamic: bool) -> dict[str, float]:
    """Per-token time of the eager and compiled variants, and each compiled variant's first (compiling) loop."""
    results: dict[str, float] = {}
    # The trainer decodes under inference mode; compiled graphs need ordinary tensors, so they get their own
    # decoder (same seed, same weights) built under no_grad.
    with torch.inference_mode():
        eager_decoder = build()
        variants = {"eager": (eager_decoder, eager_decoder.step, False, torch.inference_mode),
                    "eager_static": (eager_decoder, static_step(eager_decoder), True, torch.inference_mode)}
    with torch.no_grad():
        decoder = build()
    compiled = {"compiled_static": (decoder, torch.compile(static_step(decoder), dynamic=False), True, torch.no_grad)}
    if dynamic:
        compiled["compiled_dynamic"] = (decoder, torch.compile(decoder.step, dynamic=True), False, torch.no_grad)
    for name, (dec, step, static, mode) in {**variants, **compiled}.items():
        start = time.perf_counter()
        with mode():
            decode_loop(dec, step, static)  # warm-up; for the compiled ones, the compilation
        if name in compiled:
            results[f"{name}_first_loop_wall_s"] = time.perf_counter() - start
    variants.update(compiled)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # one loop per variant per round, interleaved
        for name, (dec, step, static, mode) in variants.items():
            with mode():
                samples[name].append(us_per_token(dec, step, static))
    results.update({f"{name}_us_per_token": statistics.median(values) for name, values in samples.items()})
    for name in compiled:
        saved = results["eager_us_per_token"] - results[f"{name}_us_per_token"]
        results[f"{name}_saved_us_per_token"] = saved
        results[f"{name}_over_eager"] = results[f"{name}_us_per_token"] / results["eager_us_per_token"]
        # Rollouts (of NEW tokens each) before the one-off compilation is paid back by the per-token saving.
        results[f"{name}_break_even_rollouts"] = (results[f"{name}_first_loop_wall_s"] * 1e6 / (saved * NEW)
                                                  if saved > 0 else float("inf"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="Decode loops timed per variant (median).")
    parser.add_argument("--dynamic", action="store_true", help="Also compile the eager step with dynamic=True.")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    fast_decoder.PACK_MIN_ELEMENTS = 2**62
    results = {**measure_widths(opts.repeats), **measure_compile(opts.repeats, opts.dynamic)}
    for key, value in results.items():
        print(f"{key:40s} {value:12.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
