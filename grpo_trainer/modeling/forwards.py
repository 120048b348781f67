"""The trainer's log-prob forwards: log-probs (and entropies) of a micro-batch's completion tokens, padded or packed.

`score` is the one entry point of the trainer's log-prob forwards (policy, old, reference) whose positions are not
sharded (under sequence parallelism they run through `modeling.sequence_parallel.sharded_scores`, which enters the
same `installed` context). It runs the padded forward (`logprobs.completion_logprobs`) or the packed one
(`packed_logprobs`, the layout of `modeling.packing`); both return the same `LogProbs`: `[B, T]` float32, equal on
every completion token up to float rounding. Decisions:

1. Packing is used only where it cannot silently be wrong:
   - refused by rule (`REFUSALS`, each rule a function of the model and the call returning its reason or None):
     image inputs and 3-D rope positions (Qwen2-VL-style models: positions per image grid, not restarting per
     sequence), a vision-language model, layers that carry state along a row (linear attention, state-space
     layers), an attention implementation that has neither transformers' mask functions nor a varlen kernel,
     a forward without `position_ids`, FSDP2 or ZeRO-3 (the LM head runs inside the forward), the MoE router's
     auxiliary loss (it would count the filler tokens), a model whose logits are not its LM head's output;
   - and once per model (`self_check`), on its first micro-batch, with dropout off, two or more sequences per row:
     (a) isolation: perturbing each row's first sequence must leave the log-probs of the sequences after it
     exactly where they were (masked attention weights are exact zeros: any change is a leak, in any dtype);
     (b) agreement: packed log-probs of every token but each sequence's first equal the padded forward's within the
     compute dtype's rounding (`TOLERANCES`). On a failure, or any error, the model is scored padded from then on,
     with the reason logged. A model that ignores the mask, lets a cache in (`use_cache`: with a cache transformers
     does not look for restarting positions, so packed sequences attend to each other), or re-derives positions
     fails here.
   Each refusal is logged once per model and reason.
2. The check runs on every process at the same call, whatever its rows (three forwards more, once), so ZeRO-3's
   gathered forwards stay in step; afterwards each call is one forward, packed or padded.
   It runs on a slice of the first micro-batch whose size does not grow with the completion length
   (`check_slice`): its first `CHECK_ROWS` rows, each cut to the first tokens of its sequence, at most
   `CHECK_TOKENS` of them plus the model's attention window (sliding or chunked attention), the rows cut to
   different lengths. A causal model's log-probs of a sequence's first k tokens do not depend on the tokens after
   them, so the slice is checked exactly as these tokens of the full rows would be; rows of different lengths keep
   left padding in the padded forward and packing boundaries at different offsets; a sequence longer than the
   attention window keeps the window's masking across a packing boundary in view. At T = 4096 the whole micro-batch
   made the first step 1.85x a later one, the slice 1.02x (benchmarks/RESULTS.md, "First step at long
   completions").
3. On-policy replay (the rollout's layer outputs, `modeling.replay`) composes with packing: each layer's output
   is gathered into the packed layout, and the backward recomputes each layer on packed rows. So does a
   Mixture-of-Experts model's routing replay (`modeling.routing`, `routes`): every forward, padded or packed, routes
   each token to the sampler's experts, gathered into the packed layout like the layer outputs.
4. The packed layout is the cheapest `packing.plan` finds for the model's `packing_cost`; a micro-batch whose
   packed rows would not cost less than its padded ones (one sequence, little padding) runs padded.
5. Every modification of a forward is installed by one context (`installed`), in one order, for the padded, packed
   and sharded paths alike: replay's layer stand-ins (`modeling.replay`), routing replay (`modeling.routing`), the
   sequence tiling (`modeling.tiling`, inside replay's context, so that it wraps replay's checkpoint stand-in: the
   layer function replay recomputes in the backward is the tiled one), and the tied lookup, open until the head has
   scored (it hands its gradient to the lookup).
6. The tied lookup (`modeling.tied_embedding`) is an option (`ForwardSettings.tied_lookup`): on CUDA it is held back
   until it has run on a GPU (`planning.levers`).

Shapes: `B` rows, `S + T` columns, `T` completion columns, `V` vocabulary, `L` decoder layers, `E` hidden size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling import replay, routing, tiling
from grpo_trainer.modeling.logprobs import LogProbs, completion_logprobs, head_runs_inside_forward, scoring_head
from grpo_trainer.modeling.packing import PackedBatch, PackingCost, PackingSettings, plan_of
from grpo_trainer.modeling.support import KeptSupport
from grpo_trainer.modeling.tied_embedding import tied_lookup
from grpo_trainer.modeling.unwrap import causal_lm

logger = logging.getLogger(__name__)

__all__ = ["CHECK_ROWS", "CHECK_TOKENS", "REFUSALS", "TOLERANCES", "Call", "ForwardSettings", "check_slice",
           "installed", "is_varlen", "packed_logprobs", "refusal", "score", "self_check"]

CHECK_ROWS = 4  # rows of the first micro-batch the self-check packs (decision 2): two packed rows of two sequences
CHECK_TOKENS = 128  # tokens per sequence the self-check keeps at most, beyond the model's attention window


@dataclass(frozen=True)
class ForwardSettings:
    """The training forward's options: built once from the config (`config.settings.forward_settings`, where a
    default held back on CUDA is resolved: `planning.levers`), held by the scorer (`trainer.scoring`) and by the
    memory plan (`planning.PlanSettings.forward`), so that the two read the same values."""

    padding_free: bool  # no default: resolved from `GRPOConfig.padding_free` for the device
    temperature: float = 1.0
    chunk_size: int = 1024  # `logprob_chunk_size`: LM-head rows per chunk, at most (`logprobs.chunk_rows`)
    pad_to_multiple_of: int | None = None
    mlp_tile_tokens: int = 0  # `mlp_tile_tokens`: the MLP computed this many tokens at a time (`modeling.tiling`)
    recompute_attention: bool = False  # `recompute_attention`: each attention block checkpointed (`modeling.tiling`)
    tied_lookup: bool = True  # `tied_embedding_lookup`: a tied lookup's rows into the head's gradient (decision 6)
    activation_offloading: bool = False  # `activation_offloading`: the step's saved tensors in host memory (GPU)


@dataclass(frozen=True)
class Call:
    """What a rule may look at besides the model: this call's extra inputs."""

    with_aux_loss: bool = False
    model_inputs: dict | None = None


# Attention implementations whose masks transformers builds with its mask functions, which detect packed
# sequences from restarting positions when there is no attention mask and no cache (masking_utils).
_MASKED_ATTENTION = ("eager", "sdpa", "flex_attention")
# Layer kinds (`config.layer_types`) that mix tokens only through masked attention, or not at all (NemotronH's
# "moe" and "mlp" blocks); any other (linear attention, Mamba, short convolutions) carries a state or a window along
# the row, across sequences.
_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "moe", "mlp")


def _attention(lm: nn.Module) -> str:
    config = lm.config.get_text_config()
    return str(getattr(config, "_attn_implementation", None) or "eager")


def is_varlen(attention: str) -> bool:
    """flash-attention (2, 3, or a hub kernel of it): varlen kwargs, attention per sequence (no dense mask over a
    packed row; the memory plan asks the same question)."""
    return "flash" in attention


def _varlen(lm: nn.Module) -> bool:
    return is_varlen(_attention(lm))


def _numel(parameter: nn.Parameter) -> int:
    return getattr(parameter, "ds_numel", parameter.numel())  # ZeRO-3 partitions to 0 elements: its full size


def packing_cost(lm: nn.Module) -> PackingCost:
    """`lm`'s forward work per token (2 x its parameters other than the embeddings and the LM head, whose rows the
    packed and padded forwards look up or project alike; a Mixture-of-Experts model's every expert counted, so its
    per-token work is overestimated, which only favours packing) and per pair of tokens in a row (4 x layers x
    attention width), for `packing.plan`."""
    embeddings = {id(m.weight): m.weight for m in (lm.get_input_embeddings(), lm.get_output_embeddings())
                  if m is not None}
    parameters = sum(_numel(p) for p in lm.parameters()) - sum(_numel(w) for w in embeddings.values())
    if _varlen(lm):
        return PackingCost(token=2.0 * parameters, pair=0.0)
    config = lm.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    return PackingCost(token=2.0 * parameters, pair=4.0 * config.num_hidden_layers * width)


def _images(model: nn.Module, call: Call) -> str | None:
    if call.model_inputs:
        return "image inputs: a vision-language model's image tokens and positions are laid out per padded row"
    return None


def _vision_language(model: nn.Module, call: Call) -> str | None:
    config = causal_lm(model).config
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model: its forward lays out image tokens, masks and positions per padded row"
    return None


def _rope_3d(model: nn.Module, call: Call) -> str | None:
    lm = causal_lm(model)
    config = lm.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "mrope_section" in rope or any(hasattr(m, "get_rope_index") for m in (lm, getattr(lm, "model", None))):
        return "3-D rope position ids (Qwen2-VL-style): positions follow image grids, not one count per sequence"
    return None


def _recurrent_layers(model: nn.Module, call: Call) -> str | None:
    kinds = set(getattr(causal_lm(model).config.get_text_config(), "layer_types", None) or ())
    others = sorted(kinds - set(_ATTENTION_LAYERS))
    if others:
        return f"layers of kind {others} carry a state or a convolution along the row, across sequences"
    return None


def _attention_implementation(model: nn.Module, call: Call) -> str | None:
    lm = causal_lm(model)
    name = _attention(lm)
    if name not in _MASKED_ATTENTION and not _varlen(lm):
        return (f"attention implementation {name!r}: neither transformers' mask functions (which keep packed "
                "sequences apart) nor a varlen kernel")
    return None


def _without_positions(model: nn.Module, call: Call) -> str | None:
    parameters = inspect.signature(causal_lm(model).forward).parameters
    if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return "its forward takes no position_ids, so positions cannot restart per sequence"
    return None


def _sharded_head(model: nn.Module, call: Call) -> str | None:
    if head_runs_inside_forward(model):
        return ("FSDP2 or a ZeRO-3 partitioned head: the LM head must run inside the model's forward "
                "(modeling.logprobs), on padded rows")
    return None


def _aux_loss(model: nn.Module, call: Call) -> str | None:
    if call.with_aux_loss:
        return "the MoE router's auxiliary loss would count the packed rows' filler tokens"
    return None


# Rule name -> rule(model, call): the reason packing cannot serve this call, or None. Checked in this order.
REFUSALS: dict[str, Callable[[nn.Module, Call], str | None]] = {
    "images": _images,
    "vision_language": _vision_language,
    "rope_3d": _rope_3d,
    "recurrent_layers": _recurrent_layers,
    "attention_implementation": _attention_implementation,
    "without_positions": _without_positions,
    "sharded_head": _sharded_head,
    "aux_loss": _aux_loss,
}


def refusal(model: nn.Module, call: Call) -> str | None:
    """The first rule's reason packing cannot serve `model` for this call, or None."""
    for rule in REFUSALS.values():
        reason = rule(model, call)
        if reason is not None:
            return reason
    return None


@dataclass(frozen=True)
class Tolerance:
    """How far the self-check lets packed log-probs be from the padded ones (the largest and the mean absolute
    difference), and how far perturbing one packed sequence may move another's (`isolation`: without a leak, not
    at all, since masked attention weights are exact zeros and every other value is computed alike)."""

    max_abs: float
    mean_abs: float
    isolation: float


# By the dtype the model computes in. Layouts differ by reduction order (float32: <= 1e-6 on the tiny models of
# tests/modeling/test_forwards.py) and, in half precision, by each layout rounding its own intermediate values. A leak
# between packed sequences moved random tiny models' log-probs by 0.2-0.4 (mean 0.04), within bf16's layout noise,
# which is why isolation is checked on its own.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(1e-3, 1e-4, 1e-6),
    torch.float64: Tolerance(1e-8, 1e-9, 1e-12),
    torch.bfloat16: Tolerance(0.5, 0.05, 1e-3),
    torch.float16: Tolerance(0.1, 0.01, 1e-4),
}


def _compute_dtype(lm: nn.Module, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return lm.get_input_embeddings().weight.dtype


def _no_cache(model: nn.Module, out: Any) -> None:
    """The `use_cache` trap: a forward that made a KV cache did not look for packed sequences (transformers checks
    restarting positions only without one), so its packed sequences attended to each other. Read under the name the
    output's class declares: from transformers 5.24 the old name is a property that logs a deprecation warning."""
    fields = getattr(type(out), "__dataclass_fields__", None)  # transformers 5.24 renamed the output's cache field
    names = ("cache", "past_key_values") if fields is None or "past_key_values" in fields else ("cache",)
    if any(out.get(name) is not None for name in names):
        raise RuntimeError(f"{type(causal_lm(model)).__name__} returned a KV cache from a packed forward called with "
                           "use_cache=False: with a cache its packed sequences attend to each other.")


@contextlib.contextmanager
def installed(lm: nn.Module, settings: ForwardSettings, layer_outputs: Tensor | None = None,
              routes: Tensor | None = None, sources: tuple[Tensor, Tensor] | None = None,
              stats: routing.ReplayStats | None = None) -> Iterator[None]:
    """Every modification of `lm`'s forward this call asks for, in decision 5's order: replay of the rollout's layer
    outputs `[B, L, S + T, E]`, routing replay of its experts `[B, S + T, L, k]` (`sources`: the packed layout's
    source cells, None padded), the sequence tiling, and the tied lookup. Leave the context after the head scored."""
    with contextlib.ExitStack() as stack:
        if settings.tied_lookup:
            stack.enter_context(tied_lookup(lm))
        if layer_outputs is not None:
            stack.enter_context(replay.replayed_layers(lm.get_decoder().layers, layer_outputs, sources))
        if routes is not None:
            stack.enter_context(routing.replaying(lm, routes, sources, stats))
        stack.enter_context(tiling.tiled_layers(lm, settings.mlp_tile_tokens, settings.recompute_attention))
        yield


def packed_logprobs(model: nn.Module, packed: PackedBatch, settings: ForwardSettings, with_entropy: bool = False,
                    known: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
                    layer_outputs: Tensor | None = None, support: KeptSupport | None = None,
                    routes: Tensor | None = None, routing_stats: routing.ReplayStats | None = None) -> LogProbs:
    """`completion_logprobs` on a packed micro-batch: the same `[B, T]` values on the completion tokens, 0 elsewhere.

    Args:
        known: the rollout's (logps `[B, T]`, entropies `[B, T]`, tempered softmax `[B, T, V]`), or Nones.
        layer_outputs: `[B, L, S + T, E]` the rollout's layer outputs to replay (`modeling.replay`), or None.
        support: the sampler's truncation, its supports `[B*T, W]` in row order where given (gathered into the
            packed order of the scored tokens, and the supports used scattered back).
        routes: `[B, S + T, L, k]` the sampler's experts to replay (`modeling.routing`), or None.
        routing_stats: counts the routes replay changed, when given.
    """
    lm = causal_lm(model)
    extra: dict[str, Any] = packed.flash_kwargs() if _varlen(lm) else {}
    with installed(lm, settings, layer_outputs, routes, packed.sources, routing_stats):  # decision 5
        out = model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                    logits_to_keep=1, output_hidden_states=True, use_cache=False, **extra)
        return _score_packed(model, out, packed, settings, with_entropy, known, support)


def _score_packed(model: nn.Module, out: Any, packed: PackedBatch, settings: ForwardSettings, with_entropy: bool,
                  known: tuple[Tensor | None, Tensor | None, Tensor | None], support: KeptSupport | None) -> LogProbs:
    """`packed_logprobs`'s scoring of the packed forward's output `out` through the model's LM head."""
    lm = causal_lm(model)
    _no_cache(model, out)
    scorer = scoring_head(model, out, settings.chunk_size)
    if scorer is None:  # found by the self-check, which then scores this model padded
        raise RuntimeError(f"{type(lm).__name__}'s logits are not its LM head's output")
    final = out.hidden_states[-1]  # [R, W, E]
    hidden = final.reshape(-1, final.shape[-1])[packed.predictors]  # [N, E]
    logps, entropies = known[0], known[1]
    values = None if logps is None else (packed.gather(logps), None if entropies is None else packed.gather(entropies),
                                         known[2], None if known[2] is None else packed.target_cells)
    if support is not None and support.packed is not None:
        B, _, T = packed.padded_shape
        support = dataclasses.replace(support, packed=packed.gather(support.packed.view(B, T, -1)))  # [N, W]
    chosen, entropy, masses, kept = scorer.score(hidden, packed.tokens, settings.temperature, with_entropy, values,
                                                 support)  # [N] each; [N], [N, W] or empty
    return LogProbs(packed.scatter(chosen), packed.scatter(entropy) if with_entropy else None,
                    log_kept_mass=packed.scatter(masses) if masses.numel() else None,
                    sampling_mask=packed.scatter(kept) if support is not None and support.collect and kept.numel()
                    else None)


@contextlib.contextmanager
def _dropout_off(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout: both layouts must see the same function), restored after."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training


def _first_sequences(packed: PackedBatch) -> Tensor:
    """`[R, W]` True on each row's first sequence (the cells before the second position 0)."""
    return (packed.position_ids == 0).cumsum(1) == 1


def _attention_window(lm: nn.Module) -> int:
    """The span of a sliding-window or chunked attention layer (0 without one): Mistral's `sliding_window` (no
    `layer_types`), Gemma-2/3's sliding layers, Llama-4's `attention_chunk_size`."""
    config = lm.config.get_text_config()
    kinds = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) if kinds is None or "sliding_attention" in kinds else None
    chunked = getattr(config, "attention_chunk_size", None) if kinds is None or "chunked_attention" in kinds else None
    return max(int(sliding or 0), int(chunked or 0))


def check_slice(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The self-check's rows (decision 2): of `input_ids` `[B, S+T]` (left-padded prompts, right-padded
    completions) the first `CHECK_ROWS` rows (row 0 twice when B == 1), row i cut to the first
    min(its length, keep - i * keep / (2 * CHECK_ROWS)) tokens of its sequence, keep = CHECK_TOKENS + the model's
    attention window; returned left-padded `[R, W]`, W <= keep, whatever T is. Decreasing cuts give the rows
    different lengths (keep, 7/8, 6/8, 5/8 of it), so the padded forward has left padding and the packed rows hold
    their second sequence at different offsets even where every completion is long."""
    if input_ids.shape[0] == 1:
        input_ids, attention_mask = input_ids.repeat(2, 1), attention_mask.repeat(2, 1)
    rows = min(CHECK_ROWS, input_ids.shape[0])
    keep = CHECK_TOKENS + _attention_window(lm)
    step = keep // (2 * CHECK_ROWS)
    sequences = [row[mask.bool()][: keep - i * step] for i, (row, mask) in  # each [k_i]: a sequence's first tokens
                 enumerate(zip(input_ids[:rows], attention_mask[:rows], strict=True))]
    width = max(len(sequence) for sequence in sequences)
    ids, mask = input_ids.new_zeros(rows, width), attention_mask.new_zeros(rows, width)
    for i, sequence in enumerate(sequences):
        ids[i, width - len(sequence):], mask[i, width - len(sequence):] = sequence, 1
    return ids, mask


def self_check(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, settings: ForwardSettings
               ) -> str | None:
    """Whether packing serves `model`, on `check_slice` of `input_ids` `[B, S+T]` (a bounded slice, decision 2),
    without gradients and dropout. Packed with a budget of twice the longest sequence, so the first row holds two
    sequences or more, and scoring every token but each sequence's first:
    1. isolation: the first sequence of every row perturbed (other tokens, same length) leaves the other sequences'
       log-probs where they were;
    2. agreement: packed log-probs equal the padded forward's within the dtype's tolerance (positions, scaling).
    Returns the reason packing fails for this model, or None."""
    lm = causal_lm(model)
    input_ids, attention_mask = check_slice(lm, input_ids, attention_mask)  # [R, W], R <= CHECK_ROWS
    width = input_ids.shape[1] - 1
    lengths = attention_mask.sum(1)
    budget = int(lengths.sum()) if _varlen(lm) else 2 * int(lengths.max())
    layout = PackingSettings(token_budget=budget, pad_to_multiple_of=settings.pad_to_multiple_of)
    packed = PackedBatch.of(input_ids, attention_mask, width, layout)
    first = _first_sequences(packed)
    vocab = lm.config.get_text_config().vocab_size  # not the embedding's shape: ZeRO-3 partitions it to 0 rows
    perturbed = dataclasses.replace(packed, input_ids=torch.where(first, (packed.input_ids + 1) % vocab,
                                                                  packed.input_ids))
    try:
        with torch.no_grad(), _dropout_off(model):
            padded = completion_logprobs(model, input_ids, attention_mask, width, settings.temperature,
                                         settings.chunk_size).logps
            ours = packed_logprobs(model, packed, settings).logps
            moved = packed_logprobs(model, perturbed, settings).logps
    except Exception as error:  # noqa: BLE001 - any failure of the packed forward means: score this model padded
        return f"the packed forward failed: {type(error).__name__}: {error}"
    cells = packed.target_cells  # the tokens both layouts score: real, after a real token
    others = ~first.reshape(-1)[packed.predictors + 1]  # [N] scored tokens of a row's second sequence or later
    if not bool(others.any()):
        return "the self-check had no packed sequence after another to compare (every sequence one token long)"
    tolerance = TOLERANCES.get(_compute_dtype(lm, input_ids.device), TOLERANCES[torch.float32])
    leak = float((moved[cells] - ours[cells])[others].abs().max())
    if not leak <= tolerance.isolation:  # NaN fails too
        return (f"perturbing one packed sequence moved the log-probs of the sequences after it in its row by up to "
                f"{leak:.3g} (tolerance {tolerance.isolation:g}): its attention lets packed sequences see each other "
                "(a KV cache, a mask it builds itself, or a kernel that ignores the positions)")
    difference = (ours[cells] - padded[cells]).abs()
    largest, mean = float(difference.max()), float(difference.mean())
    if not (largest <= tolerance.max_abs and mean <= tolerance.mean_abs):
        return (f"its packed log-probs differ from the padded ones by up to {largest:.3g} (mean {mean:.3g}; "
                f"tolerance {tolerance.max_abs:g} / {tolerance.mean_abs:g}): it positions packed sequences "
                "differently")
    logger.info("padding_free: %s passed the packed-vs-padded self-check (%d rows of %d tokens; largest difference "
                "%.3g, mean %.3g; isolation %.3g).", type(lm).__name__, *packed.input_ids.shape, largest, mean, leak)
    return None


# Causal LM -> the self-check's verdict (None: packing passed), once per model.
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Causal LM -> its `PackingCost`.
_costs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Causal LM -> the refusal reasons already logged for it.
_LOGGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _log_once(lm: nn.Module, reason: str) -> None:
    logged = _LOGGED.setdefault(lm, set())
    if reason not in logged:
        logged.add(reason)
        logger.warning("padding_free: %s is scored padded: %s.", type(lm).__name__, reason)


def _packing_refused(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, settings: ForwardSettings,
                     call: Call) -> str | None:
    lm = causal_lm(model)
    reason = refusal(model, call)
    if reason is None:
        if lm not in _VERDICTS:
            _VERDICTS[lm] = self_check(model, input_ids, attention_mask, settings)
        reason = _VERDICTS[lm]
    if reason is not None:
        _log_once(lm, reason)
    return reason


def score(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_length: int,
          settings: ForwardSettings, with_entropy: bool = False,
          known: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None), with_aux_loss: bool = False,
          model_inputs: dict | None = None, layer_outputs: Tensor | None = None, support: KeptSupport | None = None,
          routes: Tensor | None = None, routing_stats: routing.ReplayStats | None = None) -> LogProbs:
    """Log-probs (and entropies) `[B, T]` of the last `completion_length` tokens of `input_ids` `[B, S+T]`: packed
    when `settings.padding_free` and the model and call allow it (decision 1), else padded.

    Args:
        known: the rollout's values under these weights (logps, entropies `[B, T]`, softmax `[B, T, V]`), on-policy.
        layer_outputs: `[B, L, S + T, E]` the rollout's layer outputs, replayed by the checkpointed layers.
        support: the sampler's truncation (`modeling.support`): log-probs over each position's kept support.
        routes: `[B, S + T, L, k]` a Mixture-of-Experts sampler's experts, replayed (`modeling.routing`);
            `routing_stats` counts the routes replay changed.
        Others: as `logprobs.completion_logprobs`.
    """
    call = Call(with_aux_loss, model_inputs)
    if settings.padding_free and _packing_refused(model, input_ids, attention_mask, settings, call) is None:
        lm = causal_lm(model)
        cost = _costs.get(lm) or _costs.setdefault(lm, packing_cost(lm))
        layout = plan_of(attention_mask, completion_length,
                         PackingSettings(cost=cost, pad_to_multiple_of=settings.pad_to_multiple_of))
        if cost.rows(*layout.shape) < cost.rows(*input_ids.shape):  # decision 4
            packed = PackedBatch.of(input_ids, attention_mask, completion_length, layout=layout)
            return packed_logprobs(model, packed, settings, with_entropy, known, layer_outputs, support, routes,
                                   routing_stats)
    with installed(causal_lm(model), settings, layer_outputs, routes, stats=routing_stats):  # decision 5
        return completion_logprobs(model, input_ids, attention_mask, completion_length, settings.temperature,
                                   settings.chunk_size, with_entropy, *known, with_aux_loss=with_aux_loss,
                                   model_inputs=model_inputs, support=support)
