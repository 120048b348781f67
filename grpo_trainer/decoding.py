"""Fast rollout sampling: each prompt prefilled once, a preallocated KV cache, a tight decode loop.

`model.generate` spends most of a small model's rollout in per-token machinery rather than in arithmetic: mask
builders, cache objects, output dataclasses and stopping criteria; and on CPU `torch.multinomial` draws one
random number per vocabulary entry (~5 ms per step at a 32k vocabulary).

Decisions:

1. Same contract as `generation.sample` (prompt rows already repeated G times in, a `generation.Rollout` out),
   so the trainer switches with `GRPOConfig.generation_backend`. `model.generate` stays the reference path: any
   model or setting this module does not reproduce exactly falls back to it (`fast_path_blocker` says why).
2. The settings are resolved and the logits processors built by transformers itself, as `generate` does (the
   model's generation config and transformers' defaults fill unset fields, e.g. `top_k=50`), so every logits
   processor `generate` would apply is applied, to the same running sequences. Greedy and multinomial sampling
   are covered; beam search, assisted decoding, stop strings and time limits fall back.
3. The decoder is the Llama family's (`ARCHITECTURES`: Llama, Mistral, Qwen2, Qwen3), run from the model's own
   modules and weights: embedding, RMSNorm weights, the rotary-embedding module, projections, MLP. Small models
   (`FUSE_MAX_PARAMETERS`) run q|k|v and gate|up as one matmul each, with vanilla LoRA adapters merged into
   those weights; otherwise plain linears run as `F.linear` on their weights and wrapped ones (LoRA,
   quantised) as their own modules, so adapters, and a disabled adapter, behave as in `forward`. The per-token
   step (`_Decoder.step`) is written for few dispatches, which cost a small model's step more than its
   arithmetic: RMSNorm through one `addmv` (`_row_rms_norm`), `addmm` on transposed views made once, cache
   columns through `select`/`narrow`.
4. Distinct prompts are found once (consecutive identical rows); each is prefilled once and its keys/values are
   copied into the rows of its G completions. Positions count real tokens only, as `generate`'s do.
5. Greedy decoding is an argmax. Sampling inverts float64 cumulative sums (`searchsorted`) in two levels, a block
   of tokens by its mass, then a token inside it, with two uniform numbers per row: the distribution of
   `torch.multinomial` (which draws one random number per vocabulary entry), not its random stream, so sampled
   tokens differ from `generate`'s for a given seed, while greedy tokens are identical.
6. The loop stops as soon as every row has emitted an EOS token; rows that finished are padded. Each token's
   log-prob and entropy under the full tempered softmax are kept (`Rollout.sampling_logps`): the trainer uses
   them as old log-probs and, on-policy, as the loss forward's values. On request the loop also keeps every
   layer's output and every step's softmax, which the loss forward and backward replay on-policy (`replay`).

Shapes: `B` rows, `P` distinct prompts, `S` prompt tokens, `T` new tokens, `L = S + T` cache columns, `H` query
heads, `K` key/value heads, `D` head dim, `E` hidden size, `V` vocabulary.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.activations import SiLUActivation
from transformers.generation import GenerationMode, LogitsProcessorList, TemperatureLogitsWarper

from grpo_trainer import generation, models, replay

__all__ = ["ARCHITECTURES", "FUSE_MAX_PARAMETERS", "GENERATION_BACKENDS", "SAMPLE_BLOCK", "fast_path_blocker",
           "sample", "sample_from_logits", "sample_from_probs"]

logger = logging.getLogger(__name__)

# model_type -> whether its attention normalises queries and keys per head (Qwen3's q_norm / k_norm).
ARCHITECTURES: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}


# --------------------------------------------------------------------------------------------- settings


def sample_from_logits(scores: Tensor, do_sample: bool) -> Tensor:
    """One token per row from processed logits `[B, V]` (float32): argmax, or a draw by CDF inversion."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return sample_from_probs(torch.softmax(scores, dim=-1, dtype=torch.float64))


# `sample_from_probs`: tokens per block of the two-level draw, and the vocabulary size up to which one
# cumulative sum is cheaper (measured at 8 rows: 28 vs 57 us at 2k tokens; 1750 vs 120 us at 32k).
SAMPLE_BLOCK = 128
ONE_LEVEL_MAX_VOCAB = 4096


def sample_from_probs(probs: Tensor, block: int = SAMPLE_BLOCK, one_level_max: int | None = None) -> Tensor:
    """One token per row of probabilities `[B, V]` (filtered tokens 0), in two draws: a block of `block`
    consecutive tokens with probability equal to its mass, then a token inside it with probability equal to its
    share of that mass. Their product is the categorical distribution. A cumulative sum runs sequentially (~2 ms
    per step at 8 x 32k on CPU); this needs one vectorised sum over V and two cumulative sums of <= V / block
    and `block` entries."""
    B, V = probs.shape
    u = torch.rand((B, 2), dtype=torch.float64, device=probs.device)
    if V <= max(block, ONE_LEVEL_MAX_VOCAB if one_level_max is None else one_level_max):
        return _inverse_cdf(probs, u[:, :1])
    full = V // block * block
    masses = probs[:, :full].reshape(B, full // block, block).sum(-1, dtype=torch.float64)  # [B, V // block]
    if full < V:
        masses = torch.cat([masses, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], dim=1)
    columns = _inverse_cdf(masses, u[:, :1])[:, None] * block + torch.arange(block, device=probs.device)
    inside = probs.gather(1, columns.clamp(max=V - 1)).masked_fill_(columns >= V, 0)  # [B, block]
    return columns.gather(1, _inverse_cdf(inside, u[:, 1:])[:, None]).squeeze(1)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Per row of non-negative `weights` `[B, N]`, the first index whose float64 cumulative weight exceeds
    `u * total` (`u` `[B, 1]` uniform in [0, 1)): index i with probability weights[i] / total. A zero weight's
    cumulative value equals its predecessor's, so it is never the first to exceed anything: never drawn."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def _resolved(lm: nn.Module, config: GenerationConfig) -> GenerationConfig:
    """The settings `generate` would run with (transformers' own resolution; private API, hence the blocker's
    fallback if it changes)."""
    return lm._prepare_generation_config(config)[0]


def _processors(lm: nn.Module, config: GenerationConfig, prompt_ids: Tensor, prompt_mask: Tensor):
    """The logits processors `generate` would build for these prompts (transformers' own constructor)."""
    return lm._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_ids.shape[1],
                                    encoder_input_ids=prompt_ids, prefix_allowed_tokens_fn=None,
                                    logits_processor=LogitsProcessorList(), device=prompt_ids.device,
                                    model_kwargs={"attention_mask": prompt_mask})


def _max_new_tokens(config: GenerationConfig, prompt_length: int) -> int:
    return config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_length


def fast_path_blocker(model: nn.Module, config: GenerationConfig, prompt_length: int) -> str | None:
    """Why this model/config must use `model.generate` (None when the fast path reproduces it)."""
    lm = models.causal_lm(model)
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    try:
        resolved = _resolved(lm, config)
        _processors(lm, resolved, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    except (AttributeError, TypeError) as error:
        return f"transformers' generation internals differ from the ones this module calls ({error})"
    max_new = _max_new_tokens(resolved, prompt_length)
    if max_new < 1:
        return "no new tokens to generate"
    return _settings_blocker(resolved) or _model_blocker(lm, prompt_length + max_new)


def _settings_blocker(config: GenerationConfig) -> str | None:
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value!r}"
    if config.max_time is not None or config.stop_strings is not None:
        return "stopping criteria max_time / stop_strings"
    if config.num_return_sequences not in (None, 1):
        return "num_return_sequences > 1"
    return None


def _model_blocker(lm: nn.Module, total_length: int) -> str | None:
    config = lm.config
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(type(p.data) is not torch.Tensor or p.numel() == 0 for p in lm.parameters()):
        return "sharded or partitioned parameters (FSDP, or ZeRO-3 without ds3_gather_for_generation)"
    if lm.training and (getattr(config, "attention_dropout", 0.0) > 0
                        or any(isinstance(m, nn.Dropout) and m.p > 0 for m in lm.modules())):
        return "dropout is active (the model is in training mode with dropout > 0)"
    decoder = lm.get_decoder()
    if not isinstance(decoder.embed_tokens, nn.Embedding) or not hasattr(decoder, "rotary_emb"):
        return "the embedding is not a plain nn.Embedding or there is no rotary-embedding module"
    if not isinstance(lm.get_output_embeddings(), nn.Linear):
        return "the LM head is not an nn.Linear"
    for layer in decoder.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < total_length:
            return f"sliding-window attention ({window} < {total_length} tokens)"
        if not all(hasattr(n, "variance_epsilon") for n in (decoder.norm, layer.input_layernorm,
                                                              layer.post_attention_layernorm)):
            return "a norm is not an RMSNorm"
    return None


# ---------------------------------------------------------------------------------------------- decoder

# Models up to this many parameters get fused projection weights (q|k|v and gate|up as one matmul each) and LoRA
# adapters merged into them for the rollout: fewer, larger operations, at the cost of a copy of those weights.
FUSE_MAX_PARAMETERS = 2**27


def _lora_weights(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The weight and bias a PEFT LoRA `Linear` applies (base + every active adapter's delta), if it is vanilla
    LoRA over a plain `nn.Linear`; None otherwise."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return None
    if not isinstance(module, LoraLinear) or type(module.base_layer) is not nn.Linear:
        return None
    base = module.base_layer
    if module.merged:  # the base weight already holds the delta, unless the adapter is disabled (forward unmerges)
        return None if module.disable_adapters else (base.weight, base.bias)
    if module.disable_adapters:
        return base.weight, base.bias
    active = [a for a in module.active_adapters if a in module.lora_A]
    if any(a in module.lora_variant or module.lora_B[a].bias is not None for a in active):
        return None  # DoRA and other variants, or a LoRA bias: only the module's forward has them
    weight = base.weight
    for adapter in active:
        weight = weight + module.get_delta_weight(adapter)
    return weight, base.bias


# Plain fp32 CPU weights with at least this many entries run as oneDNN linears on a copy packed once per rollout
# (they change after every optimizer step). Measured at 8 rows on the benchmark machine: 150 -> 98 us for a
# 1024 x 512 weight, 14 -> 5.3 ms for a 32k x 512 LM head; smaller weights are faster through F.linear.
PACK_MIN_ELEMENTS = 2**18
# An unpacked fp32 CPU LM head with at least this many entries (e.g. 32k x 512) runs as `W @ h.T` (`logits`).
STREAMED_HEAD_MIN_ELEMENTS = 2**22


def _packed_linear(weight: Tensor, bias: Tensor | None, rows: int | None) -> Callable[[Tensor], Tensor] | None:
    """`x -> F.linear(x, weight, bias)` through oneDNN with `weight` packed for `rows`-row inputs (any row
    count works), or None where that is not faster or not available (GPU, other dtypes, builds without it), or
    not wanted (`rows` None)."""
    if rows is None or weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or weight.numel() < PACK_MIN_ELEMENTS or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except (AttributeError, RuntimeError):  # private op: fall back if a torch version lacks it
        return None
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear(weight: Tensor, bias: Tensor | None, rows: int | None) -> Callable[[Tensor], Tensor]:
    """`x -> F.linear(x, weight, bias)` for 2-D `x`: packed where that pays, else one `addmm` (or `mm`) on a
    transposed view made once, which is what `F.linear` runs after a transpose and a dispatch of its own."""
    packed = _packed_linear(weight, bias, rows)
    if packed is not None:
        return packed
    transposed = weight.t()
    if bias is None:
        return lambda x: torch.mm(x, transposed)
    return lambda x: torch.addmm(bias, x, transposed)


def _projection(modules: list[nn.Module], fuse: bool, rows: int | None) -> Callable[[Tensor], Tensor]:
    """Several projections of one input, outputs concatenated on the last dim. With `fuse`, plain and vanilla
    LoRA linears become one linear on concatenated (merged) weights; otherwise plain linears run on their own
    weights and anything else (LoRA, quantised) as its own forward. `rows`: the decode batch, for packing."""
    weights = [(m.weight, m.bias) if type(m) is nn.Linear else (_lora_weights(m) if fuse else None)
               for m in modules]
    if (fuse or len(modules) == 1) and all(w is not None for w in weights):
        weight = torch.cat([w for w, _ in weights]) if len(weights) > 1 else weights[0][0]
        biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in weights]
        bias = None if all(b is None for _, b in weights) else torch.cat(biases)
        return _linear(weight, bias, rows)
    parts = [_linear(*w, rows) if w is not None else m for m, w in zip(modules, weights)]
    return parts[0] if len(parts) == 1 else (lambda x: torch.cat([part(x) for part in parts], dim=-1))


def _residual(module: nn.Module, fuse: bool, rows: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    """`(h, x) -> h + module(x)` for 2-D `h`, `x`: a packed linear plus an in-place add for large weights, one
    `addmm` for small plain (or merged LoRA) ones, else the module's forward."""
    weights = (module.weight, module.bias) if type(module) is nn.Linear else (_lora_weights(module) if fuse else None)
    if weights is None:
        return lambda h, x: h + module(x)
    weight, bias = weights
    packed = _packed_linear(weight, bias, rows)
    if packed is not None:
        return lambda h, x: packed(x).add_(h)
    transposed = weight.t()
    if bias is None:
        return lambda h, x: torch.addmm(h, x, transposed)
    return lambda h, x: torch.addmm(h, x, transposed).add_(bias)


def _row_rms_norm(weight: Tensor, eps: float, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """RMSNorm of 2-D `x` `[N, E]` of `dtype`: `x / sqrt(mean(x^2) + eps) * weight`, as the model's norm computes
    it. In float32 the mean square is one `addmv`, eps + (x * x) @ (1/E): five dispatches in all, where
    `F.rms_norm`'s composite makes 23 (dtype conversions of its scalars included). A decode step of a small model
    is a chain of such tiny operations, and the norms were a sixth of it. Other dtypes, or a weight kept in
    another dtype than the hidden states, take `F.rms_norm`, which computes in float32 as the model's norm does."""
    E = weight.shape[0]
    if weight.dtype != torch.float32 or dtype != torch.float32:
        return lambda x: F.rms_norm(x, (E,), weight, eps)
    inverse_width, eps_ = weight.new_full((E,), 1.0 / E), weight.new_full((1,), eps)
    return lambda x: (x * torch.addmv(eps_, x * x, inverse_width).rsqrt_().unsqueeze(1)).mul_(weight)


class _Decoder:
    """A Llama-family decoder over a preallocated KV cache `[B, K, L, D]` per layer; hidden states `[N, S, E]`."""

    def __init__(self, lm: nn.Module, batch: int, length: int, outputs: Tensor | None = None) -> None:
        config, decoder = lm.config, lm.get_decoder()
        fuse = sum(p.numel() for p in lm.parameters()) <= FUSE_MAX_PARAMETERS
        # Packed weights are copies too: only where fused copies are accepted. The caches always have `batch` rows.
        rows = batch if fuse else None
        self.embed, self.rotary = decoder.embed_tokens.weight, decoder.rotary_emb
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.row_norm = _row_rms_norm(*self.norm, self.embed.dtype)
        head = lm.get_output_embeddings()
        packed_head = _packed_linear(head.weight, head.bias, rows) if type(head) is nn.Linear else None
        self.head = packed_head or _projection([head], fuse=False, rows=rows)
        big_cpu_head = packed_head is None and type(head) is nn.Linear and head.bias is None \
            and head.weight.device.type == "cpu" and head.weight.numel() >= STREAMED_HEAD_MIN_ELEMENTS
        self.head_weight = head.weight if big_cpu_head else None
        self.H, self.K = config.num_attention_heads, config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        qk_norm = ARCHITECTURES[config.model_type]
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gated = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            self.layers.append({
                "norm1": norm1,
                "norm2": norm2,
                "row_norm1": _row_rms_norm(*norm1, self.embed.dtype),
                "row_norm2": _row_rms_norm(*norm2, self.embed.dtype),
                "qkv": _projection([attn.q_proj, attn.k_proj, attn.v_proj], fuse, rows),
                "o_add": _residual(attn.o_proj, fuse, rows),
                "qk_norm": (attn.q_norm, attn.k_norm) if qk_norm else None,
                "scaling": attn.scaling,
                "gate_up": _projection([mlp.gate_proj, mlp.up_proj], fuse, rows) if gated else None,
                "down_add": _residual(mlp.down_proj, fuse, rows) if gated else None,
                # SiLU as a function call: a module call costs more than the activation itself at 8 rows.
                "act": (F.silu if type(mlp.act_fn) in (nn.SiLU, SiLUActivation) else mlp.act_fn) if gated else None,
                "mlp": mlp,
            })
        shape = (batch, self.K, length, self.D)
        self.keys = [self.embed.new_empty(shape) for _ in self.layers]
        self.values = [self.embed.new_empty(shape) for _ in self.layers]
        self.outputs = outputs  # where every layer's output at every column goes `[B, layers, L, E]`, or None

    def rotation_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin `[N, S, 1, D]` for positions `[N, S]`, from the model's rotary module.

        `x * cos + rotate_half(x) * sin` == `x * cos + roll(x, D/2) * sin'` with sin' = cat(-sin[:D/2], sin[D/2:]):
        the same products (negation is exact), in four operations instead of seven."""
        cos, sin = self.rotary(self.embed[:1], positions)  # [N, S, D]
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final hidden states `[N, E]` -> float32 logits `[N, V]`."""
        hidden = self.row_norm(hidden)
        if self.head_weight is not None:
            # A CPU head larger than the caches (e.g. 32k x 512 floats) is memory-bound for a few rows, and
            # `W @ h.T` streams it in row order: ~1.6x faster than `F.linear` (measured on the benchmark machine).
            return (self.head_weight @ hidden.T).T.float()
        return self.head(hidden).float()

    def forward(self, ids: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """Tokens `[N, S]` at cache columns `[start, start + S)` of rows `[0, N)`: writes their keys and values
        and returns the last position's hidden state `[N, E]`. cos/sin `[N, S, 1, D]`; mask (True = may attend)
        `[N, 1, S, start + S]` (bool, or additive float)."""
        N, S = ids.shape
        if S == 1:
            return self.step(ids[:, 0], start, cos[:, 0], sin[:, 0], mask)
        H, K, D = self.H, self.K, self.D
        end = start + S
        hidden = self.embed[ids]  # [N, S, E]
        for index, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            x = F.rms_norm(hidden, hidden.shape[-1:], *layer["norm1"])
            qkv = layer["qkv"](x.view(N * S, -1)).view(N, S, H + 2 * K, D)
            qk = qkv[:, :, :H + K]
            if layer["qk_norm"] is not None:
                q_norm, k_norm = layer["qk_norm"]
                qk = torch.cat([q_norm(qk[:, :, :H]), k_norm(qk[:, :, H:])], dim=2)
            qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin  # rotary embedding
            keys[:N, :, start:end] = qk[:, :, H:].transpose(1, 2)
            values[:N, :, start:end] = qkv[:, :, H + K:].transpose(1, 2)
            q = qk[:, :, :H].transpose(1, 2)  # [N, H, S, D]
            k = keys[:N, :, :end].repeat_interleave(H // K, dim=1)
            v = values[:N, :, :end].repeat_interleave(H // K, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer["scaling"]).transpose(1, 2)
            hidden = layer["o_add"](hidden.reshape(N * S, -1), attn.reshape(N * S, H * D)).view(N, S, -1)
            x = F.rms_norm(hidden, hidden.shape[-1:], *layer["norm2"])
            if layer["gate_up"] is None:
                hidden = hidden + layer["mlp"](x)
            else:
                gate, up = layer["gate_up"](x.view(N * S, -1)).chunk(2, dim=-1)
                hidden = layer["down_add"](hidden.view(N * S, -1), layer["act"](gate) * up).view(N, S, -1)
            if self.outputs is not None:
                self.outputs[:N, index, start:end] = hidden
        return hidden[:, -1]

    def step(self, tokens: Tensor, column: int, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """One token for every cache row, `[B]`, at cache column `column`, in 2-D tensors. Returns hidden states
        `[B, E]`. cos/sin `[B, 1, D]`; mask `[B, 1, 1, column + 1]`.

        At a small model's sizes each operation costs its dispatch more than its arithmetic, so the step is
        written for few dispatches: norms of five (`_row_rms_norm`), projections as one `addmm` on a transposed
        view made once, residual adds inside it, cache columns written through `select` and read through `narrow`
        (indexing with `[:, :, c]` makes a dispatch per dimension). Measured in `decode_variants.py`."""
        B = tokens.shape[0]
        H, K, D = self.H, self.K, self.D
        hidden = self.embed[tokens]  # [B, E]
        outputs = None if self.outputs is None else self.outputs.select(2, column)  # [B, layers, E]
        for index, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            qkv = layer["qkv"](layer["row_norm1"](hidden)).view(B, H + 2 * K, D)
            qk = qkv[:, :H + K]
            if layer["qk_norm"] is not None:
                q_norm, k_norm = layer["qk_norm"]
                qk = torch.cat([q_norm(qk[:, :H]), k_norm(qk[:, H:])], dim=1)
            qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin  # rotary embedding
            keys.select(2, column).copy_(qk[:, H:])
            values.select(2, column).copy_(qkv[:, H + K:])
            # One query token: the query heads sharing a key/value head become query rows of that head, which is
            # grouped-query attention without copying keys and values.
            attn = F.scaled_dot_product_attention(qk[:, :H].view(B, K, H // K, D), keys.narrow(2, 0, column + 1),
                                                  values.narrow(2, 0, column + 1), attn_mask=mask,
                                                  scale=layer["scaling"])
            hidden = layer["o_add"](hidden, attn.view(B, H * D))
            x = layer["row_norm2"](hidden)
            if layer["gate_up"] is None:
                hidden = hidden + layer["mlp"](x)
            else:
                gate_up = layer["gate_up"](x)  # [B, 2 I]
                inner = gate_up.shape[1] // 2
                hidden = layer["down_add"](hidden, layer["act"](gate_up.narrow(1, 0, inner))
                                           .mul_(gate_up.narrow(1, inner, inner)))
            if outputs is not None:
                outputs.select(1, index).copy_(hidden)
        return hidden


# ------------------------------------------------------------------------------------------------- entry


def _distinct_rows(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the first row of each run of identical consecutive rows `[P]`, and each row's run `[B]`."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [B-1]
    starts = torch.cat([same.new_ones(1), ~same])  # [B]
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


def sample(model: Any, prompt_ids: Tensor, prompt_mask: Tensor, generation_config: GenerationConfig,
           keep_layer_outputs: bool = False, keep_probs: bool = False) -> generation.Rollout:
    """Same inputs and output as `generation.sample`; falls back to it when `fast_path_blocker` says so.
    `keep_layer_outputs` / `keep_probs`: also return every decoder layer's output (`Rollout.layer_outputs`) /
    every step's tempered distribution (`Rollout.sampling_probs`), for `replay`, as far as they fit together in
    `replay.REPLAY_MAX_BYTES` (layer outputs first: they are the smaller)."""
    reason = fast_path_blocker(model, generation_config, prompt_ids.shape[1])
    if reason is not None:
        logger.info("generation_backend='fast' falls back to model.generate: %s.", reason)
        with torch.no_grad():
            return generation.sample(model, prompt_ids, prompt_mask, generation_config)
    lm = models.causal_lm(model)
    config = _resolved(lm, generation_config)
    eos = config.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]  # generate's fallback
    # Inference mode skips autograd bookkeeping on every operation (~20% of a small model's decode step); the
    # clones outside it make ordinary tensors that the training forward can use. Replay buffers are ordinary
    # tensors, allocated out here and filled in inference mode: never copied.
    threads = torch.get_num_threads()
    decode_threads = _decode_threads(lm, prompt_ids.shape[0]) if prompt_ids.device.type == "cpu" else threads
    outputs, probs = _replay_buffers(lm, prompt_ids, config, keep_layer_outputs, keep_probs)
    try:
        torch.set_num_threads(min(threads, decode_threads))
        with torch.inference_mode():
            completion_ids, logps, entropy = _decode(lm, config, prompt_ids, prompt_mask, eos, pad, outputs, probs)
    finally:
        torch.set_num_threads(threads)
    completion_ids, logps, entropy = completion_ids.clone(), logps.clone(), entropy.clone()
    S, T = prompt_ids.shape[1], completion_ids.shape[1]  # the used part of the buffers (views made out here)
    outputs = None if outputs is None else outputs[:, :, :S + T]
    probs = None if probs is None else probs[:, :T]
    mask, truncated = generation.completion_mask(completion_ids, eos)
    completion_ids = completion_ids.masked_fill(mask == 0, pad)
    return generation.Rollout(prompt_ids, prompt_mask, completion_ids, mask, truncated, logps, entropy, probs,
                              outputs)


def _replay_buffers(lm: nn.Module, prompt_ids: Tensor, config: GenerationConfig, layer_outputs: bool,
                    probs: bool) -> tuple[Tensor | None, Tensor | None]:
    """Empty buffers for the wanted replay tensors that fit within `replay.REPLAY_MAX_BYTES`, layer outputs
    first: every layer's output `[B, layers, S + T, E]` (zeros where nothing runs) and every step's softmax
    `[B, T, V]` float32."""
    B, S = prompt_ids.shape
    T = _max_new_tokens(config, S)
    decoder = lm.get_decoder()
    embed = decoder.embed_tokens.weight
    budget = replay.REPLAY_MAX_BYTES
    outputs_shape = (B, len(decoder.layers), S + T, embed.shape[1])
    outputs = None
    if layer_outputs and math.prod(outputs_shape) * embed.element_size() <= budget:
        outputs = embed.new_zeros(outputs_shape)
        budget -= outputs.nbytes
    probs_shape = (B, T, lm.get_output_embeddings().weight.shape[0])
    keep_probs = probs and math.prod(probs_shape) * 4 <= budget
    return outputs, torch.empty(probs_shape, device=prompt_ids.device) if keep_probs else None


def _decode_threads(lm: nn.Module, rows: int) -> int:
    """CPU threads worth using for decode steps: one per ~GFLOP of a step (2 x rows x parameters). A small
    model's step is a chain of tiny kernels where intra-op threads only add synchronisation: with 2 threads on
    the shared 2-core benchmark machine a 1M-parameter model decoded 10x slower than with 1."""
    flops = 2 * rows * sum(p.numel() for p in lm.parameters())
    return max(1, flops // 10**9)


def _choose(scores: Tensor, sequences: Tensor, processors: LogitsProcessorList,
            config: GenerationConfig, temperature: float, probs_out: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """Next tokens `[B]`, and their log-probs and the entropies `[B]` under the full tempered softmax of the raw
    logits `scores` `[B, V]` (also written to `probs_out` when given). When the only processor is the temperature
    (the trainer's default settings), the distribution sampled from is that softmax, computed once."""
    log_p = torch.log_softmax(scores if temperature == 1.0 else scores / temperature, dim=-1)  # [B, V]
    probs = log_p.exp() if probs_out is None else torch.exp(log_p, out=probs_out)
    if config.do_sample and all(type(p) is TemperatureLogitsWarper for p in processors):
        tokens = sample_from_probs(probs)
    else:
        tokens = sample_from_logits(processors(sequences, scores), config.do_sample)
    return tokens, log_p.gather(1, tokens[:, None]).squeeze(1), -torch.linalg.vecdot(probs, log_p)


def _decode(lm: nn.Module, config: GenerationConfig, prompt_ids: Tensor, prompt_mask: Tensor, eos: list[int],
            pad: int, outputs: Tensor | None = None, probs: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Completion tokens `[B, T']` (T' <= max new tokens: the loop stops once every row has ended), and their
    log-probs and entropies `[B, T']` under the full tempered softmax (`generation.Rollout.sampling_logps`).
    Fills the given buffers: every layer's output `outputs[:, :, :S + T']`, that softmax `probs[:, :T']`."""
    B, S = prompt_ids.shape
    max_new = _max_new_tokens(config, S)
    decoder = _Decoder(lm, B, S + max_new, outputs)
    device = prompt_ids.device
    eos_ids = torch.tensor(eos, device=device, dtype=torch.long)
    processors = _processors(lm, config, prompt_ids, prompt_mask)
    real = prompt_mask.long().cumsum(1)  # [B, S]
    first, group = _distinct_rows(prompt_ids, prompt_mask)

    # Prefill the P distinct prompts. A padding query attends to itself only, so no softmax row is empty.
    ids, mask = prompt_ids[first], prompt_mask[first].bool()  # [P, S]
    positions = (real[first] - 1).masked_fill(~mask, 0)  # as generate's position ids
    eye = torch.eye(S, dtype=torch.bool, device=device)
    allowed = (torch.ones_like(eye).tril() & mask[:, None, None, :]) | eye  # [P, 1, S, S]
    last_hidden = decoder.forward(ids, 0, *decoder.rotation_tables(positions), allowed)  # [P, E]
    if first.numel() < B:  # each row takes its prompt's keys and values (the gather copies before writing)
        for cache in (*decoder.keys, *decoder.values):
            cache[:, :, :S] = cache[group, :, :S]
        if decoder.outputs is not None:
            decoder.outputs[:, :, :S] = decoder.outputs[group, :, :S]
    scores = decoder.logits(last_hidden)[group]  # [B, V]

    cos, sin = decoder.rotation_tables(real[:, -1:] + torch.arange(max_new, device=device))  # [B, T, 1, D]
    # Additive key mask [B, 1, 1, L] (0 or -inf): SDPA takes it as is, where a bool mask is converted every call.
    key_mask = torch.zeros(B, 1, 1, S + max_new, dtype=decoder.embed.dtype, device=device)
    key_mask[:, 0, 0, :S].masked_fill_(prompt_mask == 0, float("-inf"))
    sequences = torch.cat([prompt_ids, prompt_ids.new_full((B, max_new), pad)], 1)  # [B, L]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    logps, entropy = torch.zeros(2, B, max_new, device=device)  # [B, T] each
    temperature = config.temperature if config.do_sample and config.temperature is not None else 1.0
    for t in range(max_new):
        tokens, logps[:, t], entropy[:, t] = _choose(scores, sequences[:, :S + t], processors, config, temperature,
                                                     None if probs is None else probs[:, t])
        tokens.masked_fill_(finished, pad)  # [B]
        sequences[:, S + t] = tokens
        finished |= torch.isin(tokens, eos_ids)
        if t == max_new - 1 or bool(finished.all()):
            break
        hidden = decoder.step(tokens, S + t, cos[:, t], sin[:, t], key_mask[..., :S + t + 1])
        scores = decoder.logits(hidden)
    return sequences[:, S:S + t + 1], logps[:, :t + 1], entropy[:, :t + 1]


def _generate(*args: Any) -> generation.Rollout:
    return generation.sample(*args)  # looked up at call time, so a patched `generation.sample` is the one used


# GRPOConfig.generation_backend -> sampler with `generation.sample`'s signature.
GENERATION_BACKENDS: dict[str, Callable[..., generation.Rollout]] = {"fast": sample, "generate": _generate}
