"""What the static decode steps (`rollout.fast.static`) hold beyond the fast decoder's own items, for the plan of a
run that uses them (`FastBackend(cuda="compact" | "graphs")`, `GRPO_TRAINER_FAST_CUDA_DECODE`).

The KV cache is the decoder's, sized once from the round (`[B, K, S + T, D]` per layer, keys and values) and
already the plan's "KV cache" item for the fast rollout; compaction moves rows inside it. On top of it:

- the step's buffers: the logits by original row `[B, V]` float32, the key mask and the rotary tables compacted
  with the cache (copies `[B, L]` and 2 x `[B, T, D]` in the weights' dtype), and the largest compaction's gather
  (one layer's keys or values `[B, K, L, D]`);
- with CUDA graphs, a pool allowance: a graph keeps the memory of every tensor its step allocates, for each
  bucket captured (`static.buckets(B)`: 1, 2, 4, ... B). Per row a step allocates at most, in the weights' dtype,
  the hidden state and its norm (2 E), q|k|v ((H + 2K) D), attention scores over all L columns (H L), gate|up and
  the activation (3 I), the LM head's output (V), and its float32 logits (4 V bytes). Counting them all as live at
  once over every bucket is an upper bound (the pool reuses freed blocks within a capture).

Shapes: `B` round rows, `S` prompt, `T` completion, `L = S + T`, `E` hidden, `I` MLP width, `H`/`K` query and
key/value heads, `D` head dim, `V` vocabulary.
"""

from __future__ import annotations

from grpo_trainer.planning.settings import ModelShape, PlanSettings
from grpo_trainer.rollout.fast.static import buckets

__all__ = ["graph_pool_bytes", "static_decode_bytes", "uses_static_decode"]


def uses_static_decode(settings: PlanSettings, shape: ModelShape) -> bool:
    """The run's rollout takes the static steps: the fast decoder serves the model, in a static mode."""
    return settings.rollout.decode_mode != "eager" and shape.model_type in settings.rollout.decoder_architectures


def graph_pool_bytes(shape: ModelShape, rows: int, columns: int, element_bytes: int) -> int:
    """Upper bound of the CUDA graphs' pool for a round of `rows` rows and `columns` = L cache columns."""
    m = shape
    per_row = element_bytes * (2 * m.hidden + (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * columns
                               + 3 * m.intermediate + m.vocab) + 4 * m.vocab
    return per_row * sum(buckets(rows))


def static_decode_bytes(settings: PlanSettings, shape: ModelShape) -> tuple[int, int]:
    """(the step's buffers, the CUDA graphs' pool: 0 without graphs or off CUDA) at the rollout instant (the
    module's docstring)."""
    B, L, T = settings.round_rows, settings.sequence_length, settings.completion_length
    element = settings.weight_bytes  # the decoder runs in the weights' dtype
    m = shape
    buffers = 4 * B * m.vocab + element * (B * L + 2 * B * T * m.head_dim) + element * B * m.kv_heads * L * m.head_dim
    graphs = settings.rollout.decode_mode == "graphs" and settings.device == "cuda"
    return buffers, graph_pool_bytes(shape, B, L, element) if graphs else 0
