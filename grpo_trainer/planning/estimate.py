"""Peak memory of one training process, itemised: pure arithmetic over `PlanSettings` and `ModelShape`.

A GRPO step passes through instants whose memory differs; the plan evaluates every item at each of them and the
peak is the largest total (`INSTANTS`):

    rollout         the round's generation: KV cache, replay buffers filling, an engine's pool (vLLM)
    scoring         reference / old log-probs of the round (no gradients); only with beta != 0, off-policy
                    rounds, or a forward at the sampling weights (an engine's importance-sampling correction,
                    asynchronous rounds' 'recompute', the mismatch report)
    loss forward    the end of a micro-batch's loss forward: saved activations, LM-head chunks
    backward start  the LM head's backward and the first layer's recomputation, activations still saved
    backward end    every gradient written, the last layer recomputed
    optimizer step  gradients and optimizer state together, with the step's temporaries

Decisions:

1. Every size is an exact product of shapes and dtypes where the code allocates a tensor of that shape (weights,
   gradients, optimizer state, KV cache, replay buffers, LM-head chunks); activations per token and layer are the
   tensors autograd saves in a Llama-family layer (`activation_bytes_per_token`, measured with
   `saved_tensors_hooks`: tests/planning/test_estimate.py). The constants the code itself uses are imported, never
   copied: `LOGITS_CHUNK_BYTES` (through `modeling.logprobs.chunk_rows`), `REPLAY_MAX_BYTES` (through `capture.plan` and
   `capture.replay_buffers`, run on the meta device), `FUSE_MAX_PARAMETERS`.
2. Within a gradient-accumulation window the first micro-step holds the whole round's replay tensors but no
   accumulated gradients, a later one the gradients but fewer replay tensors: each instant's column is the case
   (`_Case`) whose total is the larger there.
3. What a CPU process holds beyond its tensors (the interpreter, torch, transformers, tokenizer and dataset) is
   `CPU_RUNTIME_BYTES`, measured on the benchmark machine; on a GPU that memory is host memory and the device
   adds the CUDA context (`CUDA_CONTEXT_BYTES`). What an allocator holds beyond the live tensors is a ratio of
   them: `CPU_ALLOCATOR_OVERHEAD` (glibc's retained heap, an item of the CPU table) and `CUDA_RESERVED_RATIO`
   (the caching allocator's reserved blocks over allocated memory).
4. Under mixed precision autocast's casts of float32 weights are memory of their own (`_autocast_copies`), found
   with the CUDA allocator's history on an H200 (benchmarks/RESULTS.md): the LM head's cast at the end of each
   forward of the model, and with full fine-tuning autocast's cache of every trained weight's cast until the
   forward returns. The rollout is sized as the backend runs it on the device (on CUDA the fast backend samples
   with `model.generate`: `trainer.memory`), from the backend's `MemoryProfile` (`rollout.backend.memory_profile`,
   the runtime's own choice): the planner names no backend.
5. Rounds sampled ahead (`async_rollouts` = k, `trainer.producer`): k finished rounds wait through every instant
   (an upper bound: while the next one is sampled, k - 1 wait), and an in-process sampler's KV cache and working set
   overlap the loss instants (its job reads the live weights, so only the optimizer step waits for it; no copy of
   the weights is kept). Such rounds are never on-policy: no replay tensors, a scoring instant.
6. Dynamic sampling (`zero_variance_groups='resample'`, `trainer.resample`): every extra round (at most a full one,
   at most `max_resample_rounds`) is held with its replay tensors until the kept round is assembled, while the last
   one is sampled.
7. The packed layout (`padding_free`): flash-attention's varlen kernel takes no mask. Under SDPA or eager attention
   transformers builds a dense boolean `[R, 1, W, W]` mask over each packed row (`masking_utils.sdpa_mask` with
   `find_packed_sequence_indices`), and torch's SDPA converts a boolean mask to an additive bias in the query's dtype
   on every call, which the attention keeps for its backward (every layer's without checkpointing). How wide the
   rows are depends on the completions' lengths: the plan takes the widest layout the packer can choose
   (`packed_mask_elements`). The packed activations are no more than the padded ones (fewer tokens), so the padded
   sizes stand for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from grpo_trainer.modeling import routing
from grpo_trainer.modeling.logprobs import chunk_rows
from grpo_trainer.planning.optimizers import optimizer_memory
from grpo_trainer.planning.settings import ModelShape, PlanSettings
from grpo_trainer.planning.static_decode import static_decode_bytes, uses_static_decode
from grpo_trainer.rollout import capture
from grpo_trainer.rollout.fast.decoder import FUSE_MAX_PARAMETERS
from grpo_trainer.rollout.fast.static import buckets

__all__ = ["CPU_ALLOCATOR_OVERHEAD", "CPU_RUNTIME_BYTES", "CUDA_CONTEXT_BYTES", "CUDA_RESERVED_RATIO", "INSTANTS",
           "Item", "MemoryPlan", "activation_bytes_per_token", "packed_mask_elements", "plan_memory", "round_bytes",
           "tiling_saving_per_token", "tiled_mlp_transient"]

INSTANTS = ("rollout", "scoring", "loss forward", "backward start", "backward end", "optimizer step")
_R, _S, _F, _BS, _BE, _O = range(len(INSTANTS))

CPU_RUNTIME_BYTES = 560 * 2**20  # the process before its first tensor: benchmarks/RESULTS.md, "Memory planner"
# Resident memory beyond the live tensors on CPU, with glibc's heap held to them (`runtime.host_memory`: blocks from
# 4 MiB up mapped per tensor): the smaller freed blocks its heap keeps, and fragmentation, measured as 4-15% of the
# peak tensors on the benchmark grid.
CPU_ALLOCATOR_OVERHEAD = 0.10
CUDA_CONTEXT_BYTES = 600 * 2**20  # the CUDA context and kernels, outside torch's allocator
CUDA_RESERVED_RATIO = 1.1  # reserved / allocated at the peak (caching-allocator blocks); see docs/MEMORY.md
_RUNTIME = "runtime (process, libraries)"
_QUANTIZED_BYTES = {"4bit": 0.5 + 4 / 64, "8bit": 1.0}  # per packed weight: the bits plus a float32 scale per block


@dataclass(frozen=True)
class Item:
    """One thing that takes memory, with its bytes at each of `INSTANTS` (None where that instant does not occur
    in this run)."""

    name: str
    bytes: tuple[int, ...]
    note: str = ""
    host: bool = False  # CPU memory even when training on a GPU (the runtime, offloaded state)


@dataclass(frozen=True)
class MemoryPlan:
    """The itemised prediction for one process."""

    settings: PlanSettings
    shape: ModelShape
    items: tuple[Item, ...]
    occurs: tuple[bool, ...]  # which instants happen in this run
    notes: tuple[str, ...] = ()

    def totals(self, host: bool | None = None) -> tuple[int, ...]:
        """Bytes at each instant, over the device's items (host=False), the host's (True) or all (None)."""
        chosen = [i for i in self.items if host is None or i.host == host]
        return tuple(sum(i.bytes[k] for i in chosen) if self.occurs[k] else 0 for k in range(len(INSTANTS)))

    @property
    def peak_instant(self) -> str:
        totals = self.totals(host=None if self.settings.device == "cpu" else False)
        return INSTANTS[max(range(len(INSTANTS)), key=totals.__getitem__)]

    @property
    def peak_bytes(self) -> int:
        """The prediction: peak RSS on CPU, peak `torch.cuda.max_memory_allocated` on a GPU."""
        return max(self.totals(host=None if self.settings.device == "cpu" else False))

    @property
    def reserved_bytes(self) -> int:
        """Peak `torch.cuda.max_memory_reserved` (equal to `peak_bytes` on CPU)."""
        if self.settings.device == "cpu":
            return self.peak_bytes
        return int(self.peak_bytes * CUDA_RESERVED_RATIO)

    @property
    def device_bytes(self) -> int:
        """What the device must have free: peak RSS on CPU; reserved memory plus the CUDA context on a GPU."""
        if self.settings.device == "cpu":
            return self.peak_bytes
        return self.reserved_bytes + CUDA_CONTEXT_BYTES

    @property
    def host_bytes(self) -> int:
        """A GPU run's peak host (CPU) memory: the runtime and anything offloaded."""
        return max(self.totals(host=True))


# ------------------------------------------------------------------------------------------------ sizes


def activation_bytes_per_token(settings: PlanSettings, shape: ModelShape) -> int:
    """Bytes autograd saves per token in one Llama-family decoder layer (measured with `saved_tensors_hooks`:
    tests/planning/test_estimate.py):

    - each RMSNorm's input, and its normalised input where the norm's weight trains (residual dtype);
    - a linear module's input where it keeps it (`ModelShape.*_kept`): one tensor shared by q/k/v (and one by
      gate/up) without autocast, a copy per module in the compute dtype under autocast;
    - the MLP's gate, activation and up (3 x I), and down's input where it keeps it (compute dtype);
    - the attention's query, keys and values at H heads (3 x H x D) and its log-sum-exp (H, float32);
    - an adapter with dropout: its float32 dropout mask and its (compute dtype) dropped input, in place of the
      raw input (`dropout_inputs`)."""
    c, r = settings.compute_bytes, _residual_bytes(settings)
    E, ffn, HD = shape.hidden, shape.intermediate, shape.heads * shape.head_dim
    autocast = c != r

    def linear_inputs(kept: int) -> int:  # modules reading one norm's output
        return E * (kept * c if autocast else (r if kept else 0))

    norms = 2 * E * r * (2 if shape.norms_trained else 1)
    inputs = linear_inputs(shape.attention_inputs_kept) + linear_inputs(shape.mlp_inputs_kept) \
        + (HD * c if shape.output_input_kept else 0)
    mlp = (3 + shape.down_input_kept) * ffn * c
    attention = 3 * HD * c + 4 * shape.heads
    return norms + inputs + mlp + attention + shape.dropout_inputs * (4 + c)


def _mlp_inputs_bytes(settings: PlanSettings, shape: ModelShape) -> int:
    """Per token: what `activation_bytes_per_token` counts for a layer's MLP: its modules' kept inputs (gate/up's,
    one norm output; a copy per module under autocast) and its intermediates ((3 + down's input) x I)."""
    c, r = settings.compute_bytes, _residual_bytes(settings)
    kept = shape.mlp_inputs_kept
    inputs = shape.hidden * (kept * c if c != r else (r if kept else 0))
    return inputs + (3 + shape.down_input_kept) * shape.intermediate * c


def tiling_saving_per_token(settings: PlanSettings, shape: ModelShape) -> int:
    """Bytes per token and layer the sequence tiling (`modeling.tiling`) does not keep: the MLP's inputs and
    intermediates (`_mlp_inputs_bytes`), its input too where the norm before it is tiled (it keeps the norm's input,
    which the norm keeps, and rebuilds its own per tile); and each of the 2 norms' normalised input where the norm's
    weight trains (it keeps its input alone). Under ZeRO-3 the partitioned norms are not tiled: the MLP keeps its
    input, the norms theirs."""
    if not settings.forward.mlp_tile_tokens:
        return 0
    r = _residual_bytes(settings)
    if settings.zero_stage == 3:
        return _mlp_inputs_bytes(settings, shape) - shape.hidden * r
    return _mlp_inputs_bytes(settings, shape) + (2 * shape.hidden * r if shape.norms_trained else 0)


def tiled_mlp_transient(settings: PlanSettings, shape: ModelShape, rows: int) -> int:
    """The tiled MLP's backward at one layer: one tile's MLP recomputed with its graph (at most `mlp_tile_tokens`
    of the micro-batch's tokens), and the sums of its trained weights' gradients over tiles (full training: gate,
    up and down, 3 x E x I; an adapter's are small and not counted) before autograd accumulates them."""
    if not settings.forward.mlp_tile_tokens:
        return 0
    tile = min(settings.forward.mlp_tile_tokens, rows * settings.forward_length)
    sums = 0 if shape.adapter_parameters else 3 * shape.hidden * shape.intermediate * _grad_element_bytes(settings,
                                                                                                          shape)
    return tile * _mlp_inputs_bytes(settings, shape) + sums


def _attention_bytes_per_token(settings: PlanSettings, shape: ModelShape) -> int:
    """What `activation_bytes_per_token` counts for a layer's attention block past its input: queries, keys and
    values at H heads, the log-sum-exp, and o_proj's input where it keeps it. `recompute_attention` keeps none of it
    (`modeling.tiling`, decision 6): its own backward rebuilds it, one layer and one row at a time (decision 7)."""
    c, HD = settings.compute_bytes, shape.heads * shape.head_dim
    return 3 * HD * c + 4 * shape.heads + (HD * c if shape.output_input_kept else 0)


def _residual_bytes(settings: PlanSettings) -> int:
    """The residual stream's dtype: the weights', or the compute dtype for quantised weights."""
    return settings.compute_bytes if settings.quantization else settings.weight_bytes


def _mask_bytes_per_row(settings: PlanSettings) -> int:
    """The `[N, N]` attention mask each layer's SDPA call converts to the query's dtype and keeps (padding). None
    under flash-attention (no dense mask), nor in a packed forward, whose masks are their own item
    (`_packed_attention`; its bound covers a micro-batch that packs no cheaper and runs padded), nor under sequence
    parallelism (Ulysses attention runs unmasked on left-aligned rows)."""
    if settings.packs or settings.varlen_attention or settings.sequence_parallel > 1:
        return 0
    return settings.compute_bytes * settings.sequence_length ** 2


def _layer_bytes(settings: PlanSettings, shape: ModelShape, rows: int) -> int:
    """One decoder layer's saved tensors for `rows` rows, with autocast's low-precision weight copies."""
    weight_copies = shape.layer_parameters * settings.compute_bytes if settings.mixed_precision else 0
    per_token = activation_bytes_per_token(settings, shape) - tiling_saving_per_token(settings, shape) \
        - _attention_bytes_per_token(settings, shape) * settings.forward.recompute_attention
    return rows * (settings.forward_length * per_token + _mask_bytes_per_row(settings)) + weight_copies


def _weights_bytes(settings: PlanSettings, shape: ModelShape) -> int:
    """The base model's weights as loaded (4-bit / 8-bit packing of the decoder's linear weights)."""
    if settings.quantization:
        packed = shape.linear_parameters * _QUANTIZED_BYTES[settings.quantization]
        return int(packed + (shape.parameters - shape.linear_parameters) * settings.compute_bytes)
    return shape.parameters * settings.weight_bytes


def _grad_element_bytes(settings: PlanSettings, shape: ModelShape) -> int:
    """Adapters train in float32 (PEFT upcasts them over low-precision weights); full training in the weights'."""
    return 4 if shape.adapter_parameters else settings.weight_bytes


def _kv_bytes(settings: PlanSettings, shape: ModelShape, rows: int, element_bytes: int) -> int:
    return 2 * shape.layers * rows * shape.kv_heads * settings.sequence_length * shape.head_dim * element_bytes


def _no_grad_layer_bytes(settings: PlanSettings, shape: ModelShape, rows: int, tokens: int, tiled: bool = False
                         ) -> int:
    """A gradient-free forward's transient per layer (gate, up, their product, the attention's q/k/v/out); `tiled`:
    a log-prob forward with the sequence-tiled MLP, whose gate, up and product exist for one tile at a time."""
    E, ffn, HD = shape.hidden, shape.intermediate, shape.heads * shape.head_dim
    mlp_tokens = rows * tokens
    if tiled and settings.forward.mlp_tile_tokens:
        mlp_tokens = min(mlp_tokens, settings.forward.mlp_tile_tokens)
    return settings.compute_bytes * (rows * tokens * (4 * E + 3 * HD) + mlp_tokens * 3 * ffn)


def _autocast_copies(settings: PlanSettings, shape: ModelShape, layers_saved: bool = False) -> int:
    """Autocast's low-precision copies of float32 weights alive when one model forward under mixed precision ends.
    Autocast caches the cast of every weight that trains until the forward returns (full fine-tuning: each decoder
    layer's); a frozen weight's cast (LoRA's base layers) lives while its module computes; the LM head, called last
    (`logits_to_keep=1`), has its cast alive at the end either way. `layers_saved`: the layers' copies are already
    counted as saved tensors (`_layer_bytes` without checkpointing)."""
    if not settings.mixed_precision or settings.quantization:
        return 0
    layers = 0 if shape.adapter_parameters or layers_saved else shape.layers * shape.layer_parameters
    return (layers + shape.head_parameters) * settings.compute_bytes


def _chunk_rows(settings: PlanSettings, shape: ModelShape) -> int:
    """Rows of one LM-head chunk (`modeling.logprobs.chunk_rows`), at most a micro-batch's completion tokens."""
    return min(chunk_rows(settings.forward.chunk_size, shape.vocab), settings.micro_batch * settings.completion_length)


def _chunk_bytes(settings: PlanSettings, shape: ModelShape) -> int:
    """One LM-head chunk's float32 logits `[rows, V]`."""
    return _chunk_rows(settings, shape) * shape.vocab * 4


def _replay_bytes(settings: PlanSettings, shape: ModelShape) -> tuple[int, int]:
    """Bytes of the round's replay tensors (layer outputs, softmax) as `rollout.capture` sizes them: its own `plan`
    and `replay_buffers`, run on the meta device. Only the fast backend keeps them: its decoder both kinds, its
    model-forward tier (non-Llama architectures) the softmax only."""
    if not settings.rollout.sampling_probs:
        return 0, 0
    wanted = capture.plan(training=True, on_policy=settings.on_policy,
                          plain_single_process=settings.plain_single_process, checkpointing=settings.checkpointing)
    if not settings.rollout.layer_outputs or shape.model_type not in settings.rollout.decoder_architectures:
        wanted = capture.Capture(layer_outputs=False, probs=wanted.probs, max_bytes=wanted.max_bytes)
    outputs, probs = capture.replay_buffers(
        wanted, rows=settings.round_rows, prompt_length=settings.prompt_length,
        max_new_tokens=settings.completion_length, layers=shape.layers, hidden_size=shape.hidden,
        vocab_size=shape.vocab, dtype=getattr(torch, settings.weight_dtype), device=torch.device("meta"))
    return (0 if outputs is None else outputs.nbytes), (0 if probs is None else probs.nbytes)


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class _Case:
    """A micro-step of the loss instants (decision 2): whether gradients from earlier micro-steps are held, and
    the fraction of the round's replay tensors still held."""

    accumulated: bool
    replay_left: float


def _cases(settings: PlanSettings) -> list[_Case]:
    """The first micro-step of a window, and (with accumulation) a later one."""
    mid_window = (settings.steps_per_generation * settings.num_iterations) % settings.accumulation_steps != 0
    cases = [_Case(accumulated=mid_window, replay_left=1.0)]
    if settings.accumulation_steps > 1:
        left = 1.0 if mid_window else (settings.steps_per_generation - 1) / settings.steps_per_generation
        cases.append(_Case(accumulated=True, replay_left=left))
    return cases


class _Builder:
    """Collects items; each is given by its bytes at the instants where it is alive."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    def add(self, name: str, at: dict[int, int | float], note: str = "", host: bool = False) -> None:
        values = tuple(int(at.get(k, 0)) for k in range(len(INSTANTS)))
        if any(values):
            self.items.append(Item(name, values, note, host))

    def everywhere(self, name: str, size: int | float, note: str = "", host: bool = False) -> None:
        self.add(name, dict.fromkeys(range(len(INSTANTS)), size), note, host)


def _persistent(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    """Held through every instant: runtime, weights, reference, adapter, optimizer state, DeepSpeed's copies."""
    gpu = s.device == "cuda"
    b.everywhere(_RUNTIME, CPU_RUNTIME_BYTES, "measured constant", host=gpu)
    weight_shards = s.processes if s.shards_weights else 1
    dtype = f"{s.quantization} + {s.weight_dtype}" if s.quantization else s.weight_dtype
    shard_note = f", 1/{weight_shards} (sharded)" if weight_shards > 1 else ""
    offloaded = gpu and s.offload_parameters
    b.everywhere("weights", _weights_bytes(s, m) / weight_shards,
                 f"{m.parameters / 1e6:.1f}M x {dtype}{shard_note}", host=offloaded)
    if m.adapter_parameters:
        b.everywhere("adapter weights", m.adapter_parameters * 4 / weight_shards,
                     f"{m.adapter_parameters / 1e6:.2f}M x float32")
    if s.beta != 0.0 and not m.adapter_parameters:
        b.everywhere("reference model", _weights_bytes(s, m) / weight_shards, f"a frozen copy (beta={s.beta:g})",
                     host=offloaded)
    trainable, element = m.trainable, _grad_element_bytes(s, m)
    optimizer_shards = s.processes if s.shards_optimizer else 1
    cost = optimizer_memory(trainable, element, m, s)
    note = f"{s.optimizer}" + ("" if cost.known else " (not in the planner's table: counted as AdamW)") \
        + (f", 1/{optimizer_shards}" if optimizer_shards > 1 else "")
    b.everywhere("optimizer state", cost.state_bytes / optimizer_shards, note, host=gpu and s.offload_optimizer)
    if s.zero_stage:
        b.everywhere("DeepSpeed float32 master weights", 4 * trainable / optimizer_shards,
                     f"ZeRO-{s.zero_stage}'s float32 partition", host=gpu and s.offload_optimizer)
    if s.processes > 1 and not s.zero_stage and not s.fsdp:
        b.everywhere("DDP gradient buckets", trainable * element, "a flat copy of every gradient")


def _gradient_sizes(b: _Builder, s: PlanSettings, m: ModelShape) -> tuple[int, int]:
    """(every gradient, the LM head's) per process; DeepSpeed's reduce bucket beside them."""
    element = _grad_element_bytes(s, m)
    shards = s.processes if s.shards_gradients else 1
    full = m.trainable * element / shards
    head = 0 if m.adapter_parameters else m.head_parameters * element / shards  # the LM head's: written first
    if s.zero_stage in (1, 2) and s.processes > 1:
        bucket = min(s.zero_reduce_bucket, m.trainable) * element
        b.add("DeepSpeed reduce bucket", {_BS: bucket, _BE: bucket, _O: bucket}, "reduce_bucket_size elements")
    return int(full), int(head)


class _Saved(NamedTuple):
    """What the loss forward leaves for the backward, and the backward's recomputation."""

    saved: int  # every tensor the loss forward keeps
    recompute: int  # one layer's tensors rebuilt in the backward (checkpointing), or a tile of the MLP
    note: str
    ends: int  # of `saved`: the final norm's input and output, released once the final norm's backward has run
    layer_input: int  # one layer's input `[rows, N, E]` (checkpointing keeps it; its recomputation reads it)


def _saved_activations(s: PlanSettings, m: ModelShape) -> _Saved:
    rows, N, r = s.micro_batch, s.forward_length, _residual_bytes(s)
    layer_input = rows * N * m.hidden * r
    ends = 2 * layer_input  # the final norm's input (the last layer's output) and output (the LM head's input)
    tiles = tiled_mlp_transient(s, m, rows)  # a tile of the MLP recomputed in the backward (0 untiled)
    if not s.forward.mlp_tile_tokens:  # the untiled MLP's backward: an intermediate's gradient `[rows, N, I]`
        tiles = rows * N * m.intermediate * s.compute_bytes
    # recompute_attention: one attention block rebuilt in its backward, beside the input it read (a norm's output),
    # one row at a time (`modeling.tiling`, decision 7) but in flash-attention's one packed row of every sequence
    at_once = rows if s.packs and s.varlen_attention else 1
    attention = N * (at_once * _attention_bytes_per_token(s, m) + rows * m.hidden * r) \
        if s.forward.recompute_attention else 0
    if s.checkpointing:
        # the recomputed layer's first norm reads the layer's input, which the checkpoint keeps: counted once
        return _Saved(layer_input * m.layers + ends, max(_layer_bytes(s, m, rows) - layer_input + tiles, attention),
                      f"each layer's input, {rows} rows x {N} tokens (checkpointing)", ends, layer_input)
    per_token = activation_bytes_per_token(s, m) - tiling_saving_per_token(s, m) \
        - _attention_bytes_per_token(s, m) * s.forward.recompute_attention
    return _Saved(m.layers * _layer_bytes(s, m, rows) + ends, max(tiles, attention),
                  f"{per_token} B per token and layer, {rows} rows x {N} tokens", ends, 0)


# TRL's `OffloadActivations` keeps the last `max_fwd_stash_size` (5) offloaded tensors on the device until their
# copies are done; in the backward it holds the tensor in use and the next one it brings back.
OFFLOAD_STASH = 5


def offload_stash(s: PlanSettings, m: ModelShape, saved: int) -> tuple[int, int]:
    """Device bytes activation offloading leaves in flight (forward's end, backward): `OFFLOAD_STASH` and 2 of the
    largest tensors the loss forward saves, at most the `saved` bytes themselves. Under checkpointing each is a
    layer's input `[rows, N, E]`; without it the largest is an MLP intermediate `[rows, N, I]` (tiled: not saved)."""
    rows, N = s.micro_batch, s.forward_length
    widest = m.hidden * _residual_bytes(s)
    if not s.checkpointing and not s.forward.mlp_tile_tokens:
        widest = max(widest, m.intermediate * s.compute_bytes)
    return min(OFFLOAD_STASH * rows * N * widest, saved), min(2 * rows * N * widest, saved)


def _head_chunks(s: PlanSettings, m: ModelShape, replay_probs: int) -> tuple[int, int, int]:
    """LM-head buffers (`modeling.logprobs`): float32 logits of `chunk_rows` rows at a time in the loss forward,
    in its backward, and in a gradient-free scoring forward."""
    chunk = _chunk_bytes(s, m)
    plain = not s.shards_weights  # a ZeRO-3 / FSDP head goes through the checkpointed per-chunk path
    # the rollout's values stand in for the loss forward's on-policy; the sequence-sharded forward recomputes them
    known = s.on_policy and s.temperature_matches and s.rollout.sampling_logps and s.sequence_parallel == 1
    forward = 0 if plain and known else (2 if plain else 3) * chunk
    if not plain:
        backward = 5 * chunk
    elif replay_probs and not s.entropy_gradient:
        backward = 0 if s.weight_bytes == 4 else chunk // 4 * s.weight_bytes  # the kept softmax cast to the head's
    else:
        backward = (3 if s.entropy_gradient else 1) * chunk
    return forward, backward, (1 if plain else 3) * chunk


def _backward(b: _Builder, s: PlanSettings, m: ModelShape, case: _Case, replay: tuple[int, int]) -> None:
    """The loss forward and the backward's two peaks. Backward start: the LM head's backward (its chunks, the
    current micro-batch's kept softmax), or the last layer's recomputation after it (the final norm's input and
    output released by then), whichever is larger. Backward end: the input embedding's backward (a tied
    embedding's rows' gradient, added into the head's by `modeling.tied_embedding`, or under ZeRO-3 / FSDP and for
    other lookups its own V x E gradient), or the first layer's recomputation before it (with that layer's
    checkpointed input). The trainer drops the micro-batch (`del inputs`) before the backward, so its kept layer
    outputs are gone by then; the softmax lives until the head's backward has used it."""
    full, head_grad = _gradient_sizes(b, s, m)
    saved, recompute, note, ends, layer_input = _saved_activations(s, m)
    forward_chunks, backward_chunks, _ = _head_chunks(s, m, replay[1])
    outputs, probs = replay
    current = 1 / s.steps_per_generation  # this micro-batch's share of the round
    others = max(0.0, case.replay_left - current)
    grads = max(full * case.accumulated, head_grad)
    head_moment = backward_chunks + probs * current
    bs_head = head_moment >= recompute - ends  # the final norm's tensors are gone by the last layer's recomputation
    grad_hidden = 2 * s.micro_batch * s.forward_length * m.hidden * _residual_bytes(s)
    tied, tied_note = 0, ""
    if m.tied_head and not m.adapter_parameters and m.plain_lookup and s.forward.tied_lookup \
            and not s.shards_weights:
        # `modeling.tied_embedding`: the lookup adds its rows into the head's gradient (their masked copy here)
        tied, tied_note = grad_hidden // 2, "the lookup's rows' gradient, added into the head's (tied)"
    elif m.tied_head and not m.adapter_parameters:
        tied = m.head_parameters * _grad_element_bytes(s, m) / (s.processes if s.shards_gradients else 1)
        tied_note = "the input embedding's own V x E gradient, before it joins the head's (tied)"
    be_embedding = tied >= recompute + layer_input  # the first layer's input lives through its recomputation
    mid_window = _cases(s)[0].accumulated
    element = _grad_element_bytes(s, m)
    b.add("gradients", {_R: full * mid_window, _S: full * mid_window, _F: full * case.accumulated, _BS: grads,
                        _BE: full, _O: full},
          f"{m.trainable / 1e6:.1f}M x {element} B" + (f", 1/{s.processes} (sharded)" if s.shards_gradients
                                                        and s.processes > 1 else "") + "; the LM head's first")
    if s.forward.activation_offloading and s.device == "cuda":
        b.add("activations", {_F: saved, _BS: saved}, note + "; offloaded (activation_offloading)", host=True)
        forward_stash, backward_stash = offload_stash(s, m, saved)
        b.add("offloading stash", {_F: forward_stash, _BS: backward_stash, _BE: backward_stash},
              f"saved tensors in flight: {OFFLOAD_STASH} at the forward's end, 2 in the backward")
    else:
        b.add("activations", {_F: saved, _BS: saved - ends * (not bs_head), _BE: layer_input * (not be_embedding)},
              note)
    copies = _autocast_copies(s, m, layers_saved=not s.checkpointing)
    b.add("autocast weight copies", {_F: copies, _BS: copies if s.shards_weights else 0},
          f"{s.mixed_precision} casts of the weights at the forward's end (the LM head's"
          + ("" if m.adapter_parameters else ", every trained layer's (autocast's cache)") + ")")
    if s.shards_weights:  # the head inside the forward (`modeling.logprobs.head_runs_inside_forward`)
        logits = s.micro_batch * (s.completion_length + 1) * m.vocab * s.compute_bytes
        b.add("model logits", {_F: logits, _BS: 2 * logits},
              f"ZeRO-3 / FSDP: [{s.micro_batch}, T+1, V] in the compute dtype, and their gradient")
    b.add("log-prob chunks", {_F: forward_chunks, _BS: backward_chunks * bs_head},
          f"{_chunk_rows(s, m)} rows x V={m.vocab} float32 per chunk")
    b.add("layer recomputation", {_BS: recompute * (not bs_head), _BE: recompute * (not be_embedding)},
          "one layer's saved tensors, rebuilt in the backward")
    b.add("tied embedding gradient", {_BE: tied * be_embedding}, tied_note)
    b.add("hidden-state gradients", {_BS: grad_hidden, _BE: grad_hidden}, "flowing between layers")
    total = outputs + probs
    if total:
        b.add("replay tensors", {_R: total, _S: total * (2 if s.steps_per_generation > 1 else 1),
                                 _F: total * case.replay_left, _BS: total * others + probs * current * bs_head,
                                 _BE: total * others},
              f"layer outputs {outputs / 2**20:.0f} MiB + softmax {probs / 2**20:.0f} MiB of the round "
              f"(REPLAY_MAX_BYTES); Round.split copies them while the round is held")


def _rollout(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    rows, S = s.round_rows, s.prompt_length
    gpu = s.device == "cuda"
    # Decision 5: a round sampled ahead by the policy in this process is sampled while the step trains (its job
    # reads the live weights, so only the optimizer step waits for it): its rollout items overlap every other instant.
    during = (_R, _S, _F, _BS, _BE) if s.rounds.sampling_overlaps_step else (_R,)
    if s.rollout.cache == "remote":
        return
    if s.rollout.cache == "engine":
        _vllm(b, s, m)
        return
    if s.rollout.cache == "paged":
        pool = s.continuous_memory_fraction * s.device_total_bytes
        b.add("continuous-batching cache", {_R: pool or _kv_bytes(s, m, rows, s.compute_bytes)},
              "transformers' paged cache (max_memory_percent)")
        return
    fast = m.model_type in s.rollout.decoder_architectures
    kv_element = s.weight_bytes if fast else s.compute_bytes
    decoded = s.decoded_rows  # partial rollouts: the parked and extra groups decode beside the round's
    kv = _kv_bytes(s, m, decoded, kv_element) * s.decode_columns // s.sequence_length
    if not fast:  # transformers' cache grows by concatenation: one layer's old and new cache side by side
        kv += kv // m.layers
    # speculative rollouts: a row's last draft writes past its completion, and one forward verifies up to
    # `verify_positions` positions (their logits, softmax and draws, and one layer's transient over them)
    draft = s.rollout.draft_columns if fast else 0
    kv = kv * (s.sequence_length + draft) // s.sequence_length
    b.add("KV cache", dict.fromkeys(during, kv),
          f"{decoded} rows x {s.decode_columns + draft} tokens x {m.layers} layers x {kv_element} B"
          + ("" if decoded == rows else " (partial rollouts: parked and extra groups, resumed rows' tokens so far)"))
    if draft:  # in host memory: the round's n-gram indexes, and the history kept across rounds (its bound)
        b.add("speculative draft indexes", dict.fromkeys(during, rows * (s.sequence_length + draft)
                                                             * s.rollout.draft_index_bytes_per_token),
              "the round's tokens' n-gram indexes (rollout.speculative.drafts)", host=True)
        b.everywhere("speculative history", s.rollout.draft_history_bytes,
                     "earlier rounds' completions, at most history_tokens, and the cached indexes", host=True)
    distinct = rows // s.num_generations if fast else rows
    positions = max(rows, s.rollout.verify_positions) if fast else rows
    layer = max(_no_grad_layer_bytes(s, m, distinct, S), _no_grad_layer_bytes(s, m, 1, positions) if draft else 0)
    step = layer + 4 * positions * m.vocab * 4
    b.add("generation working set", dict.fromkeys(during, step + (0 if fast else _autocast_copies(s, m))),
          ("prefill of one layer, per-token logits and softmax" if not draft else
           f"prefill of one layer or a verifying forward's, logits and softmax of up to {positions} positions")
          + ("" if fast or not s.mixed_precision else "; autocast's weight copies in each forward"))
    if fast and m.parameters <= FUSE_MAX_PARAMETERS:
        copies = m.linear_parameters * s.weight_bytes + (0 if gpu else m.head_parameters * s.weight_bytes)
        b.add("fused decoder weights", dict.fromkeys(during, copies), "q|k|v and gate|up copies (small models)")
    if s.zero_stage == 3 and s.gather_for_generation and s.processes > 1:
        b.add("ZeRO-3 gathered weights", {_R: _weights_bytes(s, m)}, "ds3_gather_for_generation")
    if uses_static_decode(s, m):  # the decoder's static steps (`rollout.fast.static`)
        buffers, pool = static_decode_bytes(s, m)
        b.add("static decode buffers", {_R: buffers},
              f"logits {rows} x {m.vocab} float32, key mask and rotary tables, one layer's compaction gather")
        b.add("CUDA graph pool", {_R: pool},
              f"decode step per bucket {buckets(rows)}: an upper bound of what each graph keeps")


def _vllm(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    if s.device == "cuda":
        pool = s.vllm_memory_fraction * s.device_total_bytes
        at = {_R: pool} if s.vllm_sleep else dict.fromkeys(range(len(INSTANTS)), pool)
        b.add("vLLM engine", at, f"vllm_gpu_memory_utilization={s.vllm_memory_fraction:g} of the GPU")
        if s.vllm_sleep:
            b.everywhere("vLLM weights while asleep", m.parameters * 2, "offloaded to CPU memory", host=True)
        return
    engine = m.parameters * 2 + s.vllm_cpu_kv_bytes
    b.everywhere("vLLM engine (CPU)", engine, "its bfloat16 weights and VLLM_CPU_KVCACHE_SPACE")


def _scoring(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    b.add("scoring forward", {_S: _no_grad_layer_bytes(s, m, s.micro_batch, s.forward_length, tiled=True)
                              + _autocast_copies(s, m)},
          "one layer at a time, no gradients" + (" (and autocast's weight copies)" if s.mixed_precision else ""))
    if s.shards_weights:  # the head inside the forward here too (`modeling.logprobs.head_runs_inside_forward`)
        b.add("scoring model logits", {_S: s.micro_batch * (s.completion_length + 1) * m.vocab * s.compute_bytes},
              f"ZeRO-3 / FSDP: [{s.micro_batch}, T+1, V] in the compute dtype")


def round_bytes(s: PlanSettings, m: ModelShape) -> int:
    """One round's tensors: ids and masks `[B, S + T]` (int64), log-probs, entropies, advantages... `[B, T]`
    (6 float32 columns), and its routes under routing replay."""
    rows, N, T = s.round_rows, s.sequence_length, s.completion_length
    routes = routes_bytes(s, m) if s.routing_replay and m.routed_layers else 0
    return rows * N * 8 * 2 + rows * T * 4 * 6 + routes


def _round(b: _Builder, s: PlanSettings, m: ModelShape, replay: tuple[int, int]) -> None:
    rows, N = s.round_rows, s.sequence_length
    routes = routes_bytes(s, m) if s.routing_replay and m.routed_layers else 0
    b.add("round tensors", dict.fromkeys(range(_O), round_bytes(s, m) - routes), f"{rows} rows")
    if routes:
        b.add("routes (routing replay)", dict.fromkeys(range(_O), routes),
              f"{rows} rows x {N} tokens x {m.routed_layers} MoE layers x top-{m.routed_top_k}")
    if s.rounds.ahead:  # decision 5: finished rounds wait in the producer's queue through every instant
        b.add("rounds held ahead", dict.fromkeys(range(len(INSTANTS)), s.rounds.ahead * round_bytes(s, m)),
              f"async_rollouts={s.rounds.ahead}: rounds sampled ahead wait for their step (the sampler reads the "
              "live weights: no snapshot)")
    if s.resample_rounds:  # decision 6
        held = s.resample_rounds * (round_bytes(s, m) + sum(replay))
        b.add("resampled rounds", {_R: held},
              f"zero_variance_groups='resample': up to {s.resample_rounds} extra rounds held until the round is "
              "assembled")


def packed_mask_elements(s: PlanSettings, m: ModelShape) -> int:
    """The most elements `e = R x W^2` of a packed micro-batch's dense attention masks (decision 7).

    `modeling.packing.plan` keeps the cheapest layout, and one sequence per row (budget: the longest) is among those
    it weighs, so `R (token W + pair W^2) <= B (token N + pair N^2)`. With `x = R W` and `c = token / pair =
    2 L P_layer / (4 L H D)` (`modeling.forwards.packing_cost`) that is `c x + e <= K = B N (N + c)`, and `e = x W
    <= x^2` (R >= 1). The largest `e` meeting both is where `x^2 = K - c x`: `x = (sqrt(c^2 + 4 K) - c) / 2`,
    `e = x^2` (B = 2 rows: one of N tokens and one of 0.56 N packed into one row, 2.44 N^2 at c = N)."""
    B, N = s.micro_batch, s.sequence_length
    c = m.layer_parameters // (2 * m.heads * m.head_dim)
    K = B * N * (N + c)
    x = (math.isqrt(c * c + 4 * K) - c) // 2  # at most the root (isqrt floors); x is R W, an integer
    while (x + 1) ** 2 + c * (x + 1) <= K:  # up to the largest integer with x^2 + c x <= K
        x += 1
    return max(x * x, K - c * (x + 1))  # at x + 1, e <= K - c x binds


def _packed_attention(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    """Decision 7: a packed forward under SDPA or eager attention masks each packed row densely, unless no row holds
    two sequences (`modeling.packing`: causal, no mask), which one row per micro-batch guarantees."""
    if not s.packs or s.varlen_attention or s.micro_batch == 1:
        return
    elements = packed_mask_elements(s, m)
    mask, bias = elements, elements * s.compute_bytes  # bool [R, 1, W, W]; each attention call's additive copy
    kept = 1 if s.checkpointing else m.layers  # the copies the attention keeps for its backward
    b.add("packed attention mask", {_S: mask + bias, _F: mask + kept * bias, _BS: mask + kept * bias,
                                    _BE: mask + bias},
          f"padding_free: <= {elements:,} mask elements (bool) and SDPA's {s.compute_bytes}-byte bias per layer call")


def routes_bytes(s: PlanSettings, m: ModelShape) -> int:
    """A round's routes `[B, S + T, L_moe, k]` in the smallest integer dtype holding codes 0..E
    (`modeling.routing.code_dtype`)."""
    code = torch.tensor([], dtype=routing.code_dtype(m.experts)).element_size()
    return s.round_rows * s.sequence_length * m.routed_layers * m.routed_top_k * code


def _sharded_working_set(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    """ZeRO-3 / FSDP gather a layer (and the LM head or embedding, one tensor of V x E) while it computes."""
    if not s.shards_weights or s.processes == 1:
        return
    gathered = (m.layer_parameters + m.head_parameters) * s.weight_bytes
    b.add("gathered parameters", {_S: gathered, _F: gathered, _BS: gathered, _BE: gathered},
          "one layer and the V x E head, gathered while in use")


def _optimizer_step(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    cost = optimizer_memory(m.trainable, _grad_element_bytes(s, m), m, s)
    b.add("optimizer step temporaries", {_O: cost.step_bytes}, s.optimizer)


def _instants(s: PlanSettings) -> tuple[bool, ...]:
    """Which instants occur: scoring only with a reference model, off-policy rounds (old log-probs) or a forward at
    the sampling weights (`PlanSettings.sampler_scored`)."""
    scoring = s.beta != 0.0 or not s.on_policy or s.sampler_scored
    return tuple(k != _S or scoring for k in range(len(INSTANTS)))


def _scoring_chunks(b: _Builder, s: PlanSettings, m: ModelShape) -> None:
    b.add("scoring chunks", {_S: _head_chunks(s, m, 0)[2]}, "reference / old log-probs, no gradients")


def _build(s: PlanSettings, m: ModelShape, case: _Case, replay: tuple[int, int]) -> tuple[Item, ...]:
    b = _Builder()
    _persistent(b, s, m)
    _rollout(b, s, m)
    _round(b, s, m, replay)
    _packed_attention(b, s, m)
    _scoring(b, s, m)
    _scoring_chunks(b, s, m)
    _backward(b, s, m, case, replay)
    _sharded_working_set(b, s, m)
    _optimizer_step(b, s, m)
    return tuple(b.items)


def plan_memory(settings: PlanSettings, shape: ModelShape) -> MemoryPlan:
    """The itemised memory of one process of this run, at the micro-step case that peaks (decision 2)."""
    replay = _replay_bytes(settings, shape)
    occurs = _instants(settings)
    candidates = [_build(settings, shape, case, replay) for case in _cases(settings)]
    items = _worst_per_instant(candidates, occurs)
    if settings.device == "cpu":
        tensors = [sum(i.bytes[k] for i in items if i.name != _RUNTIME) for k in range(len(INSTANTS))]
        items += (Item("allocator overhead", tuple(int(CPU_ALLOCATOR_OVERHEAD * t) for t in tensors),
                       f"{CPU_ALLOCATOR_OVERHEAD:.0%} of the tensors: freed heap kept by glibc, fragmentation"),)
    notes = []
    if settings.mixed_precision and replay[0]:
        notes.append("the rollout keeps layer outputs for replay, which autocast then does not use (replay runs "
                     "without autocast only)")
    if settings.rollout.cache == "engine" and settings.device == "cuda":
        notes.extend(_vllm_notes(settings, shape))
    if settings.device == "cpu" and not settings.heap_held:
        notes.append("glibc's heap is left to its own mmap threshold (GRPO_TRAINER_GLIBC_HEAP=keep or "
                     "MALLOC_MMAP_THRESHOLD_ set): what it keeps of the backward's freed tensors is not counted "
                     "(20% above the plan measured at 512-1,024 tokens)")
    return MemoryPlan(settings, shape, items, occurs, tuple(notes))


def _worst_per_instant(candidates: list[tuple[Item, ...]], occurs: tuple[bool, ...]) -> tuple[Item, ...]:
    """One column per instant, each from the case whose total is largest there (decision 2)."""
    names = list(dict.fromkeys(i.name for items in candidates for i in items))
    by_name = [{i.name: i for i in items} for items in candidates]
    worst = [max(range(len(candidates)), key=lambda c: sum(i.bytes[k] for i in candidates[c]))
             for k in range(len(INSTANTS))]
    merged = []
    for name in names:
        first = next(items[name] for items in by_name if name in items)
        values = tuple(by_name[worst[k]][name].bytes[k] if name in by_name[worst[k]] else 0
                       for k in range(len(INSTANTS)))
        if any(values):
            merged.append(Item(name, values, first.note, first.host))
    return tuple(merged)


def _vllm_notes(s: PlanSettings, m: ModelShape) -> list[str]:
    """Whether vLLM's KV cache holds the round: its pool less its bfloat16 weights and a profiling margin."""
    pool = s.vllm_memory_fraction * s.device_total_bytes
    per_token = 2 * m.layers * m.kv_heads * m.head_dim * 2
    room = pool - m.parameters * 2 - 0.1 * pool
    longest = s.vllm_max_model_length or s.sequence_length
    if room < per_token * longest:
        return [f"vLLM cannot start: its KV cache would hold {max(0, room) // per_token:,} tokens, under one "
                f"sequence of {longest:,}; raise vllm_gpu_memory_utilization"]
    wanted = s.round_rows * s.sequence_length
    if room < per_token * wanted:
        return [f"vLLM's KV cache holds {room // per_token:,} tokens, the round wants {wanted:,} at once: it will "
                f"queue rows (slower, not out of memory)"]
    return [f"vLLM's KV cache holds {room // per_token:,} tokens; the round needs {wanted:,}"]
