"""Generation alone, in one process, on one GPU: generated tokens per second of `model.generate`, of what TRL 1.16
runs without vLLM, and of this project's decoder (eager, rows compacted, CUDA graphs), against the physical bound.

Variants (the same model, prompts and seeded log-normal completion lengths for all; `tests.toy_lengths`):

    generate            model.generate(do_sample=True): TRL's default rollout, and our backend's on CUDA (decision 5)
    generate/static     the same with cache_implementation="static": TRL with
                        generation_kwargs={"cache_implementation": "static"}
    generate_batch      model.generate_batch (transformers' continuous batching over a paged cache): TRL with
                        use_transformers_paged=True (now use_transformers_continuous_batching); its lengths are
                        the model's own (the length processor may not reach it): tokens are counted as generated
    ours/decoder        FastBackend(cuda="decoder"): the eager decoder
    ours/compact        FastBackend(cuda="compact"): finished rows compacted out (`rollout.fast.static`)
    ours/graphs         FastBackend(cuda="graphs"): that at static shapes, one CUDA graph per bucket

The physical bound: a decode step reads every weight once (and the live rows' keys and values); at the device's
memory bandwidth (measured here with a large device-to-device copy) that is the shortest step, and B tokens per
step the highest rate: `bound_tokens_per_s` = B x bandwidth / weight bytes. Each variant's `of_bound` is its rate
over that (the KV reads and the prefill make the true bound lower still).

The decoder's fused weights are copies made per rollout, so `ours/graphs` captures its graphs in every rollout,
the timed one included: the capture is part of its seconds, as it is of a training round's.

Per variant: seconds (CUDA-synchronised, after one short warm-up), generated tokens (real ones, up to each row's
EOS), tokens/s, peak memory above the model's (`torch.cuda.max_memory_allocated`). One JSON object is written to
`--json-out` (default benchmarks/results/decode_bench_<device>.json) and printed last. Sized for < 5 minutes on an
H100 at the Qwen2.5-0.5B shape, B = 16, T = 256:

    PYTHONPATH=. python benchmarks/gpu/decode_bench.py
    PYTHONPATH=. python benchmarks/gpu/decode_bench.py --shape tiny --device cpu --length 16   # a CPU dry run

Random weights from the public config (`benchmarks/shapes.py`), offline; no tokenizer (prompts are token ids).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

VARIANTS = ("generate", "generate/static", "generate_batch", "ours/decoder", "ours/compact", "ours/graphs")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048)
PAD, EOS = 0, 1


class _Timeout(Exception):
    pass


def build(shape: str, device, dtype):
    import torch
    from shapes import QWEN_SHAPES
    from transformers import AutoModelForCausalLM, Qwen2Config

    fields = TINY if shape == "tiny" else QWEN_SHAPES[shape]
    config = Qwen2Config(**fields, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def prompts_for(rows: int, groups: int, prompt_length: int, vocab: int, device):
    """`rows // groups` distinct prompts of seeded lengths in [S/2, S], left-padded, each repeated `groups` times."""
    import torch

    from grpo_trainer.rollout.types import PromptBatch

    generator = torch.Generator().manual_seed(0)
    ids = torch.full((rows // groups, prompt_length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(ids.shape[0]):
        n = int(torch.randint(prompt_length // 2, prompt_length + 1, (1,), generator=generator))
        ids[row, -n:] = torch.randint(2, vocab, (n,), generator=generator)
        mask[row, -n:] = 1
    return PromptBatch(ids.repeat_interleave(groups, 0).to(device), mask.repeat_interleave(groups, 0).to(device))


def generated_tokens(completion_ids) -> int:
    """Tokens up to and including each row's first EOS (all of a row without one)."""
    import torch

    is_eos = completion_ids == EOS
    seen = torch.cumsum(is_eos.long(), 1)
    return int(((seen == 0) | (is_eos & (seen == 1))).sum())


def run_variant(name: str, model, prompts, length: int, device) -> tuple[int, float]:
    """(generated tokens, seconds) of one rollout."""
    import torch
    from transformers import GenerationConfig

    from grpo_trainer.rollout.fast.backend import FastBackend

    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=length, eos_token_id=[EOS],
                              pad_token_id=PAD, disable_compile=True,
                              **({"cache_implementation": "static"} if name == "generate/static" else {}))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    torch.manual_seed(1)
    started = sync()
    with torch.no_grad():
        if name.startswith("generate") and name != "generate_batch":
            out = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, generation_config=config)
            completion = out[:, prompts.ids.shape[1]:]
        elif name == "generate_batch":
            inputs = [row[m.bool()].tolist() for row, m in zip(prompts.ids, prompts.mask)]
            lengths = model.__dict__.pop("_get_logits_processor", None)  # `install_lengths`' hook: not for it
            try:
                outputs = model.generate_batch(inputs, generation_config=config, progress_bar=False)
            finally:
                if lengths is not None:
                    model._get_logits_processor = lengths
            tokens = sum(len(o.generated_tokens) for o in outputs.values())
            return tokens, sync() - started
        else:
            mode = name.split("/")[1]
            backend = FastBackend(cuda=mode) if device.type == "cuda" else FastBackend(cpu=_cpu_mode(mode))
            completion = backend.generate(model, prompts, config).completion_ids
    return generated_tokens(completion), sync() - started


def _cpu_mode(mode: str) -> str:
    return {"decoder": "eager"}.get(mode, mode)


def bandwidth(device) -> float | None:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), median of 5; None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.empty(2**28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        started = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del a, b
    return 2 * 2**30 / sorted(times[1:])[2]


def measure(name: str, model, prompts, opts: argparse.Namespace, device, bound: float | None, base: int) -> dict:
    """One variant's row: a short warm-up (graphs captured there), then the timed rollout; a failure or a run over
    `--timeout` is recorded and the next variant runs."""
    import torch

    row = {"variant": name}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    signal.alarm(opts.timeout)
    try:
        run_variant(name, model, prompts, min(16, opts.length), device)
        tokens, seconds = run_variant(name, model, prompts, opts.length, device)
        row.update(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)
        if bound:
            row["of_bound"] = row["tokens_per_s"] / bound
        if device.type == "cuda":
            row["peak_above_model_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    except _Timeout:
        row["failed"] = f"over --timeout {opts.timeout}s"
    except Exception as error:  # noqa: BLE001 - a variant that fails is recorded, the others still run
        row["failed"] = f"{type(error).__name__}: {error}"
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        signal.alarm(0)
    print("# " + json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="qwen2.5-0.5b, qwen2.5-1.5b or tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rows", type=int, default=16, help="completions per rollout (B)")
    parser.add_argument("--groups", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--length", type=int, default=256, help="max_new_tokens (T)")
    parser.add_argument("--length-spread", default="64,0.8", help="MEDIAN,SIGMA of the log-normal lengths; '' all T")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=int, default=60, help="seconds per variant (warm-up and run)")
    parser.add_argument("--json-out", default=None)
    opts = parser.parse_args(argv)
    import torch

    from tests.toy_lengths import LogNormalLengths, install_lengths

    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("# no CUDA device: nothing to measure (run with --device cpu --shape tiny for a dry run)")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    dtype = getattr(torch, opts.dtype)
    model = build(opts.shape, device, dtype)
    if opts.length_spread:
        median, sigma = (float(x) for x in opts.length_spread.split(","))
        install_lengths(model, LogNormalLengths(maximum=opts.length, median=median, sigma=sigma), PAD)
    prompts = prompts_for(opts.rows, opts.groups, opts.prompt_length, model.config.vocab_size, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rate = bandwidth(device)
    bound = opts.rows * rate / weight_bytes if rate else None
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    rows = [measure(name, model, prompts, opts, device, bound, base) for name in opts.variants.split(",")]
    reference = next((r["tokens_per_s"] for r in rows if r["variant"] == "generate" and "tokens_per_s" in r), None)
    for row in rows:
        if reference and "tokens_per_s" in row:
            row["x_generate"] = row["tokens_per_s"] / reference
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    summary = {"command": " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]]),
               "device": name, "torch": torch.__version__, "shape": opts.shape, "dtype": opts.dtype,
               "rows": opts.rows, "prompt_length": opts.prompt_length, "max_new_tokens": opts.length,
               "length_spread": opts.length_spread, "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": rate,
               "bound_tokens_per_s": bound, "results": rows}
    out = Path(opts.json_out or ROOT / "benchmarks" / "results" / f"decode_bench_{name.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
