"""A Llama-family decoder over a preallocated KV cache, run from the model's own modules and weights.

Decisions:

1. Embedding, RMSNorm weights, the rotary-embedding module, projections and MLP are the model's. Small models
   (`FUSE_MAX_PARAMETERS`) run q|k|v and gate|up as one matmul each, with LoRA adapters merged into those
   weights (`modeling.lora`'s rule); otherwise plain linears run on their weights and wrapped ones (LoRA,
   quantised) as their own modules, so adapters, and a disabled adapter, behave as in `forward`.
2. The per-token step (`Decoder.step`) is written for few dispatches, which cost a small model's step more than its
   arithmetic: RMSNorm through one `addmv` (`_row_rms_norm`), `addmm` on transposed views made once, cache columns
   through `select`/`narrow`.

Shapes: `B` rows, `S` prompt tokens, `L` cache columns, `H` query heads, `K` key/value heads, `D` head dim,
`E` hidden size, `V` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import SiLUActivation

from grpo_trainer.modeling import lora
from grpo_trainer.rollout.fast.guard import ARCHITECTURES

__all__ = ["FUSE_MAX_PARAMETERS", "STREAMED_HEAD_MIN_ELEMENTS", "Decoder"]

# Models up to this many parameters get fused projection weights (q|k|v and gate|up as one matmul each) and LoRA
# adapters merged into them for the rollout: fewer, larger operations, at the cost of a copy of those weights.
FUSE_MAX_PARAMETERS = 2**27


def _lora_weights(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The weight and bias a PEFT LoRA `Linear` over a plain `nn.Linear` applies (`modeling.lora`'s one rule:
    base + every active adapter's delta, a LoRA bias included); None where that rule does not serve the layer, or
    where its forward would unmerge first (merged and disabled): then the module runs its own forward."""
    if lora.merge_blocker(module) is not None or type(module.base_layer) is not nn.Linear \
            or (module.merged and module.disable_adapters) or not lora.agrees_with_peft(module):
        return None
    return lora.applied_weight(module), lora.applied_bias(module)


# An unpacked fp32 CPU LM head with at least this many entries (e.g. 32k x 512) runs as `W @ h.T` (`logits`).
STREAMED_HEAD_MIN_ELEMENTS = 2**22


def _linear(weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """`x -> F.linear(x, weight, bias)` for 2-D `x`: one `addmm` (or `mm`) on a transposed view made once, which is
    what `F.linear` runs after a transpose and a dispatch of its own."""
    transposed = weight.t()
    if bias is None:
        return lambda x: torch.mm(x, transposed)
    return lambda x: torch.addmm(bias, x, transposed)


def _projection(modules: list[nn.Module], fuse: bool) -> Callable[[Tensor], Tensor]:
    """Several projections of one input, outputs concatenated on the last dim. With `fuse`, plain and vanilla
    LoRA linears become one linear on concatenated (merged) weights; otherwise plain linears run on their own
    weights and anything else (LoRA, quantised) as its own forward."""
    weights = [(m.weight, m.bias) if type(m) is nn.Linear else (_lora_weights(m) if fuse else None)
               for m in modules]
    if (fuse or len(modules) == 1) and all(w is not None for w in weights):
        weight = torch.cat([w for w, _ in weights]) if len(weights) > 1 else weights[0][0]
        biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in weights]
        bias = None if all(b is None for _, b in weights) else torch.cat(biases)
        return _linear(weight, bias)
    parts = [_linear(*w) if w is not None else m for m, w in zip(modules, weights)]
    return parts[0] if len(parts) == 1 else (lambda x: torch.cat([part(x) for part in parts], dim=-1))


def _residual(module: nn.Module, fuse: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """`(h, x) -> h + module(x)` for 2-D `h`, `x`: one `addmm` for plain (or merged LoRA) linears, else the module's
    forward."""
    weights = (module.weight, module.bias) if type(module) is nn.Linear else (_lora_weights(module) if fuse else None)
    if weights is None:
        return lambda h, x: h + module(x)
    weight, bias = weights
    transposed = weight.t()
    if bias is None:
        return lambda h, x: torch.addmm(h, x, transposed)
    return lambda h, x: torch.addmm(h, x, transposed).add_(bias)


def _row_rms_norm(weight: Tensor, eps: float, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """RMSNorm of 2-D `x` `[N, E]` of `dtype`: `x / sqrt(mean(x^2) + eps) * weight`, as the model's norm computes
    it. In float32 the mean square is one `addmv`, eps + (x * x) @ (1/E): five dispatches in all, where
    `F.rms_norm`'s composite makes 23 (dtype conversions of its scalars included), and a small model's decode step
    is a chain of such tiny operations. Other dtypes, or a weight kept in
    another dtype than the hidden states, take `F.rms_norm`, which computes in float32 as the model's norm does."""
    E = weight.shape[0]
    if weight.dtype != torch.float32 or dtype != torch.float32:
        return lambda x: F.rms_norm(x, (E,), weight, eps)
    inverse_width, eps_ = weight.new_full((E,), 1.0 / E), weight.new_full((1,), eps)
    return lambda x: (x * torch.addmv(eps_, x * x, inverse_width).rsqrt_().unsqueeze(1)).mul_(weight)


def _mlp_block(layer: dict, hidden: Tensor) -> Tensor:
    """A layer's second half on 2-D hidden states `[N, E]` (`step`, `verify`): `hidden + MLP(norm2(hidden))`, the
    residual add inside the down projection."""
    x = layer["row_norm2"](hidden)
    if layer["gate_up"] is None:
        return hidden + layer["mlp"](x)
    gate_up = layer["gate_up"](x)  # [N, 2 I]
    inner = gate_up.shape[1] // 2
    return layer["down_add"](hidden, layer["act"](gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner)))


class Decoder:
    """A Llama-family decoder over a preallocated KV cache `[B, K, L, D]` per layer; hidden states `[N, S, E]`."""

    def __init__(self, lm: nn.Module, batch: int, length: int, outputs: Tensor | None = None) -> None:
        config, decoder = lm.config, lm.get_decoder()
        fuse = sum(p.numel() for p in lm.parameters()) <= FUSE_MAX_PARAMETERS
        self.embed, self.rotary = decoder.embed_tokens.weight, decoder.rotary_emb
        self.norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.row_norm = _row_rms_norm(*self.norm, self.embed.dtype)
        head = lm.get_output_embeddings()
        self.head = _projection([head], fuse=False)
        big_cpu_head = type(head) is nn.Linear and head.bias is None \
            and head.weight.device.type == "cpu" and head.weight.numel() >= STREAMED_HEAD_MIN_ELEMENTS
        self.head_weight = head.weight if big_cpu_head else None
        self.H, self.K = config.num_attention_heads, config.num_key_value_heads
        self.D = getattr(config, "head_dim", None) or config.hidden_size // self.H
        qk_norm = ARCHITECTURES[config.model_type][1]
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
                "qkv": _projection([attn.q_proj, attn.k_proj, attn.v_proj], fuse),
                "o_add": _residual(attn.o_proj, fuse),
                "qk_norm": (attn.q_norm, attn.k_norm) if qk_norm else None,
                "scaling": attn.scaling,
                "gate_up": _projection([mlp.gate_proj, mlp.up_proj], fuse) if gated else None,
                "down_add": _residual(mlp.down_proj, fuse) if gated else None,
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
            # `W @ h.T` streams it in row order, faster than `F.linear` (benchmarks/RESULTS.md).
            return (self.head_weight @ hidden.T).T.float()
        return self.head(hidden).float()

    def forward(self, ids: Tensor, start: int, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """Tokens `[N, S]` at cache columns `[start, start + S)` of rows `[0, N)`: writes their keys and values
        and returns the last position's hidden state `[N, E]`. cos/sin `[N, S, 1, D]`; mask (True = may attend)
        `[N, 1, S, start + S]` (bool, or additive float)."""
        N, S = ids.shape
        if S == 1 and N == self.keys[0].shape[0]:  # `step` writes every cache row: only when all are these rows
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

    def verify(self, rows: Tensor, ids: Tensor, columns: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
               kept: Tensor | None = None) -> Tensor:
        """Tokens `[N, Q]` of cache rows `rows` `[N]` at each row's own cache columns `columns` `[N, Q]`
        (speculative rounds, `rollout.speculative`: rows advance by different counts): writes their keys and values
        there and returns every position's hidden state `[N, Q, E]`. cos/sin `[N, Q, 1, D]`; mask `[N, 1, Q, W]`
        additive over the first W cache columns (a column a query may not read, stale ones included, is -inf).
        `kept` `[N, Q]` bool: the positions whose layer outputs are written (None: all).

        Grouped-query attention without copying keys and values (as in `step`): the H / K query heads of a
        key/value head become G * Q query rows of that head, and the mask is repeated for them."""
        N, Q = ids.shape
        M = N * Q
        H, K, D = self.H, self.K, self.D
        G, W = H // K, mask.shape[-1]
        every_row = N == self.keys[0].shape[0] and bool((rows == torch.arange(N, device=rows.device)).all())
        grouped_mask = mask.unsqueeze(2).expand(N, 1, G, Q, W).reshape(N, 1, G * Q, W)
        r = rows[:, None]  # [N, 1]
        written = None
        if self.outputs is not None:
            at = torch.ones_like(ids, dtype=torch.bool) if kept is None else kept
            written = (r.expand(N, Q)[at], columns[at], at.view(-1))
        # As in `step`, in 2-D tensors `[N * Q, E]` with the row norms and the residual adds inside the projections.
        hidden = self.embed[ids.reshape(-1)]  # [M, E]
        for index, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            qkv = layer["qkv"](layer["row_norm1"](hidden)).view(N, Q, H + 2 * K, D)
            qk = qkv[:, :, :H + K]
            if layer["qk_norm"] is not None:
                q_norm, k_norm = layer["qk_norm"]
                qk = torch.cat([q_norm(qk[:, :, :H]), k_norm(qk[:, :, H:])], dim=2)
            qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin  # rotary embedding
            keys[r, :, columns] = qk[:, :, H:]  # [N, Q, K, D] at (row, column)
            values[r, :, columns] = qkv[:, :, H + K:]
            read_keys = keys[:, :, :W] if every_row else keys[rows, :, :W]  # [N, K, W, D]
            read_values = values[:, :, :W] if every_row else values[rows, :, :W]
            q = qk[:, :, :H].permute(0, 2, 1, 3).reshape(N, K, G * Q, D)  # head h = kv * G + g
            attn = F.scaled_dot_product_attention(q, read_keys, read_values, attn_mask=grouped_mask,
                                                  scale=layer["scaling"])  # [N, K, G * Q, D]
            hidden = _mlp_block(layer, layer["o_add"](hidden, attn.view(N, H, Q, D).transpose(1, 2).reshape(M, H * D)))
            if written is not None:
                self.outputs[written[0], index, written[1]] = hidden[written[2]]
        return hidden.view(N, Q, -1)

    def step(self, tokens: Tensor, column: int | Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
             rows: Tensor | None = None) -> Tensor:
        """One token for each of the first `B` cache rows, `[B]` (every row unless `fast.static` compacted them),
        at cache column `column`, in 2-D tensors. Returns hidden states `[B, E]`. cos/sin `[B, 1, D]`; mask
        `[B, 1, 1, column + 1]`. `column` as a one-element long tensor (`fast.static`'s static shapes, for CUDA
        graphs): the keys/values are written there by `index_copy_` and attention reads every cache column, mask
        `[B, 1, 1, L]` (later columns masked). `rows` `[B]`: the original row each cache row holds, where the
        layer outputs go (`outputs` is indexed by original row); None: cache row i is row i.

        At a small model's sizes each operation costs its dispatch more than its arithmetic, so the step is
        written for few dispatches: norms of five (`_row_rms_norm`), projections as one `addmm` on a transposed
        view made once, residual adds inside it, cache columns written through `select` and read through `narrow`
        (indexing with `[:, :, c]` makes a dispatch per dimension). Measured in `decode_variants.py`."""
        B = tokens.shape[0]
        H, K, D = self.H, self.K, self.D
        hidden = self.embed[tokens]  # [B, E]
        static = isinstance(column, Tensor)
        outputs = None if self.outputs is None else self.outputs.select(2, column if not static else column.item())
        caches = zip(self.keys, self.values) if B == self.keys[0].shape[0] and not static else \
            ((k.narrow(0, 0, B), v.narrow(0, 0, B)) for k, v in zip(self.keys, self.values))
        for index, (layer, (keys, values)) in enumerate(zip(self.layers, caches)):
            qkv = layer["qkv"](layer["row_norm1"](hidden)).view(B, H + 2 * K, D)
            qk = qkv[:, :H + K]
            if layer["qk_norm"] is not None:
                q_norm, k_norm = layer["qk_norm"]
                qk = torch.cat([q_norm(qk[:, :H]), k_norm(qk[:, H:])], dim=1)
            qk = qk * cos + torch.roll(qk, D // 2, dims=-1) * sin  # rotary embedding
            if static:
                keys.index_copy_(2, column, qk[:, H:].unsqueeze(2))
                values.index_copy_(2, column, qkv[:, H + K:].unsqueeze(2))
                read_keys, read_values = keys, values
            else:
                keys.select(2, column).copy_(qk[:, H:])
                values.select(2, column).copy_(qkv[:, H + K:])
                read_keys, read_values = keys.narrow(2, 0, column + 1), values.narrow(2, 0, column + 1)
            # One query token: the query heads sharing a key/value head become query rows of that head, which is
            # grouped-query attention without copying keys and values.
            attn = F.scaled_dot_product_attention(qk[:, :H].view(B, K, H // K, D), read_keys, read_values,
                                                  attn_mask=mask, scale=layer["scaling"])
            hidden = _mlp_block(layer, layer["o_add"](hidden, attn.view(B, H * D)))
            if outputs is not None:
                if rows is None:
                    outputs.select(1, index).copy_(hidden)
                else:
                    outputs.select(1, index).index_copy_(0, rows, hidden)
        return hidden
