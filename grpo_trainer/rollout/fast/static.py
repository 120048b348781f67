"""Decode steps whose cost follows the live rows: finished rows compacted out of the decoder's preallocated KV
cache, and (`graphs`) the step at static shapes per batch-size bucket, replayed as a CUDA graph on CUDA.

Decisions:

1. The KV cache is the decoder's, allocated once per round at its bound (`[B, K, S + T, D]` per layer, S the
   prompt width, T `max_new_tokens`) and never reallocated: a step writes its column in place, compaction
   moves rows inside the same tensors (`index_select` of the first rows, copied back into them).
2. Compaction lands on a bucket: the step runs on the first `bucket(live, B)` cache rows (a power of two, or B),
   live rows first, the rest rows that already ended (distinct rows, each with its own cache, fed padding as the
   eager decoder feeds them). A bucket shrinks only when the live rows fit a smaller one, so a round compacts at
   most log2(B) times, and `graphs` captures at most that many step shapes.
3. Exactness. Token selection still sees all `B` rows: the step's logits are scattered back to their original
   rows of a `[B, V]` buffer, so the loop (`loop.run`), its processors and its random draws (two uniforms per
   row per step, `sampling`) run exactly as on the eager decoder, and a live row gets the same uniforms at the
   same step. Rows that ended keep their last logits (their tokens are replaced by padding, and nothing reads
   their log-probs past the EOS: the completion mask drops them). With `compact` the step's arithmetic per row is
   the eager decoder's (same kernels on fewer rows), so a live row's logits equal the eager decoder's up to what a
   matmul's row count changes in its blocking (tested equal on CPU, float32). With `graphs` attention reads every
   cache column under a mask (static shapes), a longer reduction: tokens equal, log-probs within float rounding.
4. CUDA graphs: one graph per bucket, captured lazily at the first step at that bucket (its warm-up run is that
   step, so no column is written twice with different values), sharing one memory pool. The decoder's fused
   weights are copies made per rollout, so graphs live for one rollout. What graphs cannot serve (layer outputs
   kept for replay read a Python column index; a device that is not CUDA) runs the same static step eagerly, with
   the reason logged.

Shapes: `B` rows, `n` cache rows stepped (a bucket), `S` prompt columns, `T` new tokens, `L = S + T`, `V`
vocabulary, `D` head dim.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from grpo_trainer.rollout.fast.decoder import Decoder

__all__ = ["MODES", "StaticSteps", "bucket", "buckets", "graphs_blocker"]

logger = logging.getLogger(__name__)

# How the decode loop steps the decoder: "eager" (every row every step, the default), "compact" (finished rows
# compacted out, decision 2), "graphs" (compact, at static shapes, CUDA graphs on CUDA; decision 4).
MODES = ("eager", "compact", "graphs")


def bucket(live: int, rows: int) -> int:
    """The cache rows a step runs on for `live` unfinished rows of `rows`: the smallest power of two >= live,
    capped at `rows` (at least 1). E.g. bucket(5, 16) = 8, bucket(9, 12) = 12, bucket(0, 16) = 1."""
    return min(rows, 1 << max(0, live - 1).bit_length())


def buckets(rows: int) -> list[int]:
    """Every bucket a round of `rows` rows can step: 1, 2, 4, ... below `rows`, and `rows`. E.g. 12 -> [1, 2, 4,
    8, 12]: the shapes `graphs` may capture."""
    return sorted({bucket(live, rows) for live in range(rows + 1)})


def graphs_blocker(device: torch.device, outputs: Tensor | None) -> str | None:
    """Why the static step cannot be replayed as a CUDA graph here (it then runs eagerly), or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if outputs is not None:
        return "keeping every layer's output for replay reads the column on the host, which a graph cannot"
    return None


class StaticSteps:
    """`next_scores` for `loop.run` over a `Decoder` whose rows are compacted as they finish (decisions 2-4).

    `slots[i]`: the original row cache row i holds `[B]` (a permutation of 0..B-1); the first `n` are stepped."""

    def __init__(self, decoder: Decoder, S: int, cos: Tensor, sin: Tensor, key_mask: Tensor, eos_ids: Tensor,
                 graphs: bool) -> None:
        B = cos.shape[0]
        self.decoder, self.S, self.eos_ids = decoder, S, eos_ids
        self.cos, self.sin = cos, sin  # [B, T, 1, D] in cache-row order (compacted with the cache)
        self.static = graphs
        if graphs:  # attention over all L columns: the generated ones are unmasked as they are written
            key_mask = key_mask.clone()
            key_mask[..., S:] = float("-inf")
            # The cache is allocated uninitialised, and a masked column still enters the products (a NaN there
            # would make its row's softmax NaN, -inf weights or not): zeros until each column is written.
            for cache in (*decoder.keys, *decoder.values):
                cache[:, :, S:].zero_()
        self.key_mask = key_mask  # [B, 1, 1, L] additive, in cache-row order
        self.slots = torch.arange(B, device=cos.device)
        self.finished = torch.zeros(B, dtype=torch.bool, device=cos.device)  # by original row
        self.n = B
        self.scores: Tensor | None = None  # [B, V] float32, by original row: allocated at the first step
        reason = graphs_blocker(cos.device, decoder.outputs) if graphs else "not asked for"
        self.use_graphs = reason is None
        if graphs and reason is not None:
            logger.info("fast decoder: the static decode step runs eagerly: %s.", reason)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        self.pool = None
        self.compactions: list[tuple[int, int]] = []  # (step, rows stepped after it): what the round did

    def next_scores(self, tokens: Tensor, t: int) -> Tensor:
        """Logits `[B, V]` by original row after feeding `tokens` `[B]` (by original row) at step `t`."""
        self.finished |= torch.isin(tokens, self.eos_ids)  # the loop's own stopping rule (`loop.run`)
        live = int((~self.finished).sum())
        if bucket(live, self.n) < self.n:
            self._compact(bucket(live, self.n), t)
        n, column = self.n, self.S + t
        rows = self.slots[:n]
        step_tokens = tokens[rows]
        if self.static:
            self.key_mask[:, 0, 0, column] = 0.0  # every cache row's column `column` now holds a token
            column_index = torch.full((1,), column, dtype=torch.long, device=tokens.device)
            inputs = {"tokens": step_tokens, "column": column_index, "cos": self.cos[:n, t], "sin": self.sin[:n, t],
                      "mask": self.key_mask[:n], "rows": rows}
            logits = self._graph_step(n, inputs) if self.use_graphs else self._step(inputs)
        else:
            inputs = {"tokens": step_tokens, "column": column, "cos": self.cos[:n, t], "sin": self.sin[:n, t],
                      "mask": self.key_mask[:n, ..., :column + 1], "rows": rows}
            logits = self._step(inputs)
        if self.scores is None:
            self.scores = logits.new_zeros(self.slots.shape[0], logits.shape[1])
        return self.scores.index_copy_(0, rows, logits)

    def _step(self, inputs: dict) -> Tensor:
        decoder = self.decoder
        return decoder.logits(decoder.step(inputs["tokens"], inputs["column"], inputs["cos"], inputs["sin"],
                                           inputs["mask"], inputs["rows"]))

    def _compact(self, n: int, t: int) -> None:
        """Live rows first, then rows that ended, into the first `n` cache rows (decision 2)."""
        order = torch.argsort(self.finished[self.slots].to(torch.int8), stable=True)[:n]  # cache rows kept, [n]
        columns = self.S + t  # written so far
        for cache in (*self.decoder.keys, *self.decoder.values):
            cache[:n, :, :columns] = cache[order, :, :columns]  # the gather copies before the write
        self.cos[:n], self.sin[:n], self.key_mask[:n] = self.cos[order], self.sin[order], self.key_mask[order]
        self.slots[:n] = self.slots[order].clone()
        self.n = n
        self.compactions.append((t, n))

    def _graph_step(self, n: int, inputs: dict) -> Tensor:
        """The static step for `n` rows as a CUDA graph: captured at its first use, replayed after (decision 4)."""
        if n not in self.graphs:
            static = {name: value.clone() for name, value in inputs.items()}
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._step(static)  # the warm-up run is this step
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self._step(static)
            self.graphs[n] = (graph, static, output)
            return logits
        graph, static, output = self.graphs[n]
        for name, value in inputs.items():
            static[name].copy_(value)
        graph.replay()
        return output

