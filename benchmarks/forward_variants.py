"""Whether the training-side forwards (the reference forward, the backward's layer recompute) have slack on CPU:
two measurements on the benchmark's model shapes (`bench_vs_trl.MODEL_SIZES`), one thread, 8 rows of a
12-token prompt plus T completion tokens.

1. `reference`: the no-grad log-probs of the completion tokens as the trainer computes them (`completion_logprobs`
   through the transformers forward) against the same computation through the rollout's fused decoder layout
   (`fast_decoder.Decoder`: q|k|v and gate|up as one matmul each, inference mode, no module overhead). Equal times
   mean the forward is bound by its arithmetic, not by framework overhead.
2. `attention`: SDPA forward + backward over the whole sequence with the explicit padding mask the trainer's
   forwards need (left-padded prompts) against `is_causal=True` without a mask (what right-aligned rows would
   allow).

    PYTHONPATH=. python benchmarks/forward_variants.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import MODEL_SIZES  # noqa: E402

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer  # noqa: E402
from grpo_trainer.modeling.logprobs import _HeadLogProbs, completion_logprobs  # noqa: E402
from grpo_trainer.rollout.fast import decoder as fast_decoder  # noqa: E402

ROWS, PROMPT = 8, 12


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def reference(size: str, T: int) -> dict[str, float]:
    vocab, hidden, layers, heads = MODEL_SIZES[size]
    tokenizer = make_tokenizer(extra_vocab=vocab - len(make_tokenizer()))
    model = make_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
    model.requires_grad_(False)
    L = PROMPT + T
    ids = torch.randint(10, 2000, (ROWS, L), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[: ROWS // 2, :3] = 0  # half the prompts are 3 tokens shorter (left padding)
    head = model.get_output_embeddings()

    def transformers_forward():
        with torch.no_grad():
            return completion_logprobs(model, ids, mask, T).logps

    def fused_forward():
        with torch.inference_mode():
            dec = fast_decoder.Decoder(model, ROWS, L)
            cos, sin = dec.rotation_tables((mask.cumsum(1) - 1).clamp(min=0))
            allowed = (torch.ones(L, L, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]) \
                | torch.eye(L, dtype=torch.bool)
            N, H, K, D = ROWS, dec.H, dec.K, dec.D
            h = dec.embed[ids]
            for layer in dec.layers:
                qkv = layer["qkv"](F.rms_norm(h, h.shape[-1:], *layer["norm1"])).view(N, L, H + 2 * K, D)
                qk = qkv[:, :, :H + K]
                qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin
                attn = F.scaled_dot_product_attention(qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2),
                                                      qkv[:, :, H + K:].transpose(1, 2), attn_mask=allowed,
                                                      scale=layer["scaling"], enable_gqa=True).transpose(1, 2)
                h = layer["o_add"](h.reshape(N * L, -1), attn.reshape(N * L, H * D)).view(N, L, -1)
                gate, up = layer["gate_up"](F.rms_norm(h, h.shape[-1:], *layer["norm2"])).chunk(2, dim=-1)
                h = layer["down_add"](h.reshape(N * L, -1), (layer["act"](gate) * up).reshape(N * L, -1))
                h = h.view(N, L, -1)
            h = F.rms_norm(h[:, -T - 1:-1], h.shape[-1:], *dec.norm).reshape(-1, h.shape[-1])
            return _HeadLogProbs.apply(h, head.weight, head.bias, ids[:, -T:].reshape(-1), 1.0, 1024, False)[0]

    difference = (transformers_forward() - fused_forward().view(ROWS, T)).abs().max().item()
    repeats = 7 if size == "small" else 3
    runs = {"transformers": [], "fused": []}
    for _ in range(3):  # interleaved
        runs["transformers"].append(_median_ms(transformers_forward, repeats))
        runs["fused"].append(_median_ms(fused_forward, repeats))
    return {"transformers_ms": min(runs["transformers"]), "fused_ms": min(runs["fused"]), "max_abs_diff": difference}


def attention(size: str, T: int) -> dict[str, float]:
    _, hidden, _, heads = MODEL_SIZES[size]
    L, D = PROMPT + T, hidden // heads
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(ROWS, heads, L, D, generator=generator, requires_grad=True) for _ in range(3))
    grad = torch.randn(ROWS, heads, L, D, generator=generator)
    padded = torch.zeros(ROWS, L, dtype=torch.bool)
    padded[: ROWS // 2, :3] = True
    allowed = (torch.ones(L, L, dtype=torch.bool).tril() & ~padded[:, None, None, :]) | torch.eye(L, dtype=torch.bool)

    def masked():
        F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).backward(grad)

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    runs = {"masked": [], "causal": []}
    for _ in range(3):
        runs["masked"].append(_median_ms(masked, 7))
        runs["causal"].append(_median_ms(causal, 7))
    return {"masked_fwd_bwd_ms": min(runs["masked"]), "causal_fwd_bwd_ms": min(runs["causal"])}


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    print(f"{'model/T':<12} {'reference: transformers':>24} {'fused layout':>13} {'attention fwd+bwd: mask':>24} "
          f"{'is_causal':>10}")
    for size in MODEL_SIZES:
        for T in (64, 256):
            row = {**reference(size, T), **attention(size, T)}
            results[f"{size}/T{T}"] = row
            print(f"{size + '/T' + str(T):<12} {row['transformers_ms']:>21.1f} ms {row['fused_ms']:>10.1f} ms "
                  f"{row['masked_fwd_bwd_ms']:>21.1f} ms {row['causal_fwd_bwd_ms']:>7.1f} ms", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
