"""What each part of the small model's CPU decode step costs inside the decode loop, and whether leaner variants
of it pay: a same-process, interleaved A/B of `FastBackend.generate` with `_Decoder.step` swapped per variant.

Timing an operation alone in a hot loop says little here: inside the loop each operation finds its weights and
the dispatcher's code out of cache, and costs two to four times as much. So every variant runs the whole rollout
(8 rows, 12 prompt + 64 new tokens, the benchmark's 0.85M-parameter model, one thread), variants interleaved
round by round, and the figure is the median over rounds of each variant's time over the baseline's in the same
round.

- Ablations (wrong results, for the cost of a part): `no_norms` (both RMSNorms of every layer skipped),
  `no_attention` (the attention output replaced by the queries), `no_mlp` (the MLP skipped).
- `functional`: the step as it was before the dispatch-lean rewrite (`F.rms_norm`, cache columns written and
  read by indexing, `chunk` for gate|up); the committed step differs only in those, so this is what they save.
- Alternatives (same tokens): `layernorm_rms` (RMSNorm as the LayerNorm of [x, -x], one fused kernel instead of
  torch's composite of ~20 dispatches), `bmm_attention` (one query's grouped attention as baddbmm + softmax + bmm
  on 3-D views of the cache instead of SDPA's flash kernel). (The oneDNN-packed weights its earlier runs measured,
  `packed_2e16`, were removed from the decoder on 2026-12-01.)

    PYTHONPATH=. python benchmarks/decode_variants.py --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationConfig

from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer
from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast import decoder as fast_decoder
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.types import PromptBatch

ROWS, PROMPT, NEW = 8, 12, 64


def _layernorm_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm through LayerNorm: [x, -x] has mean 0 and mean square mean(x^2)."""
    E = x.shape[-1]
    return F.layer_norm(torch.cat([x, -x], -1), (2 * E,), torch.cat([weight, weight]), None, eps)[..., :E]


def _functional_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _cache(keys: Tensor, values: Tensor, column: int, key: Tensor, value: Tensor, indexing: bool
           ) -> tuple[Tensor, Tensor]:
    """Write one column of keys/values; return the cache's columns up to it."""
    if indexing:
        N = key.shape[0]
        keys[:N, :, column], values[:N, :, column] = key, value
        return keys[:N, :, :column + 1], values[:N, :, :column + 1]
    keys.select(2, column).copy_(key)
    values.select(2, column).copy_(value)
    return keys.narrow(2, 0, column + 1), values.narrow(2, 0, column + 1)


def _attend(kind: str, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, K: int) -> Tensor:
    """One query per row `q` `[N, H, D]` over cached `[N, K, L, D]`: SDPA, baddbmm + softmax + bmm, or (for
    the ablation) the queries themselves."""
    N, H, D = q.shape
    L = keys.shape[2]
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q.view(N, K, H // K, D), keys, values, attn_mask=mask, scale=scale)
    if kind == "bmm":
        key_mask = mask.reshape(N, 1, L).repeat_interleave(K, 0)  # [N*K, 1, L]
        scores = torch.baddbmm(key_mask, q.reshape(N * K, H // K, D), keys.reshape(N * K, L, D).transpose(1, 2),
                               alpha=scale)
        return torch.bmm(torch.softmax(scores, dim=-1), values.reshape(N * K, L, D))
    return q


def _step(norm: Callable | None | str = "row", attention: str = "sdpa", mlp: bool = True,
          indexing: bool = False) -> Callable:
    """`_Decoder.step` with its norm, attention and MLP replaceable: `norm(x, weight, eps)`, or "row" for the
    committed step's `_row_rms_norm`; `indexing` writes and reads cache columns as `[:N, :, c]` and splits
    gate|up with `chunk`, as the step did before the dispatch-lean rewrite."""

    def normed(layer: dict, which: int, x: Tensor) -> Tensor:
        if norm is None:
            return x
        if norm == "row":
            return layer[f"row_norm{which}"](x)
        return norm(x, *layer[f"norm{which}"])

    def step(self: fast_decoder.Decoder, tokens: Tensor, column: int, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        N, H, K, D = tokens.shape[0], self.H, self.K, self.D
        hidden = self.embed[tokens]
        for index, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            qkv = layer["qkv"](normed(layer, 1, hidden)).view(N, H + 2 * K, D)
            qk = qkv[:, :H + K]
            qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin
            cached_keys, cached_values = _cache(keys, values, column, qk[:, H:], qkv[:, H + K:], indexing)
            attn = _attend(attention, qk[:, :H], cached_keys, cached_values, mask, layer["scaling"], K)
            hidden = layer["o_add"](hidden, attn.reshape(N, H * D))
            if mlp:
                gate_up = layer["gate_up"](normed(layer, 2, hidden))
                if indexing:
                    gate, up = gate_up.chunk(2, dim=-1)
                else:
                    inner = gate_up.shape[1] // 2
                    gate, up = gate_up.narrow(1, 0, inner), gate_up.narrow(1, inner, inner)
                hidden = layer["down_add"](hidden, layer["act"](gate) * up)
            if self.outputs is not None:
                if indexing:
                    self.outputs[:N, index, column] = hidden
                else:
                    self.outputs.select(2, column).select(1, index).copy_(hidden)
        return hidden

    return step


VARIANTS: dict[str, Callable] = {
    "committed": fast_decoder.Decoder.step,
    "functional": _step(norm=_functional_rms, indexing=True),
    "no_norms": _step(norm=None),
    "no_attention": _step(attention="none"),
    "no_mlp": _step(mlp=False),
    "layernorm_rms": _step(norm=_layernorm_rms),
    "bmm_attention": _step(attention="bmm"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer(extra_vocab=2048 - len(make_tokenizer()))
    model = make_tiny_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4, seed=0).eval()
    prompts = torch.randint(10, 100, (ROWS // 4, PROMPT), generator=torch.Generator().manual_seed(0))
    prompts = prompts.repeat_interleave(4, 0)  # 2 prompts x 4 completions, as in the benchmark
    mask = torch.ones_like(prompts)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=[len(tokenizer) + 1], pad_token_id=0)  # no EOS: every row runs NEW
    committed_step = fast_decoder.Decoder.step

    def rollout(name: str):
        fast_decoder.Decoder.step = VARIANTS[name]
        try:
            return FastBackend().generate(model, PromptBatch(prompts, mask), config,
                                          Capture(layer_outputs=True, probs=True))
        finally:
            fast_decoder.Decoder.step = committed_step

    same = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        same[name] = rollout(name).completion_ids
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_ in range(opts.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.process_time()
            rollout(name)
            seconds[name].append(time.process_time() - start)
    results = {}
    print(f"{'variant':<15} {'ms/rollout':>10} {'vs committed':>12}  same tokens")
    for name in names:
        paired = statistics.median(s / c for s, c in zip(seconds[name], seconds["committed"]))
        results[name] = {"ms_per_rollout": 1e3 * statistics.median(seconds[name]), "over_committed": paired,
                         "same_tokens": bool(torch.equal(same[name], same["committed"]))}
        print(f"{name:<15} {results[name]['ms_per_rollout']:>10.1f} {paired:>12.3f}  {results[name]['same_tokens']}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
