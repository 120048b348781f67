"""The sequence-tiled MLP (ALST / Arctic's TiledMLP): a decoder layer's MLP computed a tile of tokens at a time, so
its `[N, I]` intermediate activations (gate, up, their product: 3 x I per token, 2-8x the hidden size) never exist for
the whole sequence, in the forward or the backward; and the layer's norms through the same function (decision 5).

Decisions:

1. An autograd function (`TiledMLP`) saves only the MLP's input `[N, E]`. Its forward runs the module's own
   forward tile by tile without a graph; its backward recomputes each tile with a graph and takes the gradients of
   that tile's input and of the module's trainable parameters (`torch.autograd.grad`; the tile's saved tensors
   kept as they are, `modeling.recompute`), summing the parameters' over
   tiles and returning them as the function's own: autograd accumulates them once into `.grad`, so DDP and
   DeepSpeed gradient hooks fire once per parameter as without tiling. Exact: every token's values are the
   untiled ones (the MLP is per token); the parameters' gradients are the same sums in another order (float32
   rounding; tests/modeling/test_tiling.py). The parameters are read at each call, not when tiling is installed:
   FSDP2 swaps the sharded parameters the module holds between forwards for unsharded ones during the layer's
   forward and backward, and those are the ones the tiles compute with (the sharded ones would get no gradient).
   Under ZeRO-3 (partitioned parameters, `_partitioned`) two things differ, as in DeepSpeed's own TiledMLP
   (`deepspeed.runtime.sequence_parallel.ulysses_sp`): each tile's call of the MLP's submodules gathers their
   parameters and is recorded in a module order that ZeRO-3 requires to be the same on every process, so the
   processes agree on one number of tiles (`_agreed_count`: enough for the largest micro-batch; the others' tiles
   are smaller, never larger); and a parameter is partitioned (shape [0]) when the function is applied, so it
   cannot take a full gradient as the function's input: the backward accumulates each tile's gradient into
   `.grad` itself, telling ZeRO to reduce it only after the last tile (`ds_grad_is_ready`). tests/distributed
   (`test_tiling_multiprocess.py`, its ZeRO-3 launch) trains with both, as the untiled run.
2. The module's own forward is what each tile runs (LoRA adapters, quantised layers, any activation), so any
   per-token MLP tiles; a Mixture-of-Experts block (routing with a capacity or an auxiliary loss over the whole
   sequence) is not per token, and is left alone (`_per_token`).
3. Tiling is installed around each log-prob forward (`tiled_layers`, from `modeling.forwards`, inside replay's
   context so that replay's recomputation is tiled too) and removed after it, so generation and the fast decoder
   see the plain model; the backward, which runs after the context has
   closed, reads the forward it needs from the function's saved context. Under activation checkpointing the layer's
   recomputation runs inside the backward, where the tiled forward is already gone: `tiled_layers` therefore also
   keeps the replacement installed on the checkpointed layers' recompute (`_checkpointed`), by wrapping the
   layer's checkpoint function for the duration of the forward and the closures it created.
4. Each tile's output is written into the whole output as it comes (`_joined`), so the forward holds one tile's
   output beside it, not every tile's and then their concatenation.
5. A norm over the last dimension (RMSNorm, LayerNorm) is per token too, and autograd keeps more for it than its
   input: transformers' RMSNorm saves the normalised input `x * rstd` `[N, E]` for its weight's gradient (and
   under a bfloat16 model a float32 copy of the input as well); the next module keeps the norm's output besides.
   Through `TiledMLP` a norm keeps only its input (the layer's input or the residual sum, which the checkpoint or
   the next norm keeps anyway) and recomputes the rest, a tile at a time, in the backward: one `[N, E]` less per
   norm and layer for a few element-wise operations. `tiled_layers` tiles each decoder layer's norms (its own and
   its attention's per-head q/k norms) and the final norm with the MLP, under the same `mlp_tile_tokens`; a norm
   whose parameters ZeRO-3 partitions is left alone, as its own forward would not gather them (`_is_norm`). A tiled
   norm's output carries how to rebuild it (the norm's forward and its input, `_REBUILD`): the tiled module that
   receives it (the MLP after the second norm) keeps the norm's input, which the norm keeps anyway, instead of it,
   and rebuilds each tile of it in its backward: one `[N, E]` less again. Whatever else reads the norm's output
   keeps it as before, so this holds whatever the layer's code does with it.
6. `recompute_attention`: each layer's attention block runs under its own non-reentrant checkpoint
   (`_recomputed`), keeping its inputs only (the norm's output, cos / sin, the mask: alive anyway). Under
   activation checkpointing the recomputed layer then holds its attention's queries, keys, values, output and
   o_proj's input only while the attention's own backward runs, after the MLP's backward has freed its tensors,
   not beside them; without checkpointing no layer keeps them. Exact (the same operations run again); the price
   is one more attention forward per layer. Its tiled children (Qwen3's q/k norms) are installed again inside its
   recomputation, where the layer's context has closed, so that it saves what the forward did. Every tensor of the
   call goes to torch's checkpoint as a positional input (`_lifted`), which it saves as a saved tensor, so that
   under a layer's checkpoint they are discarded and rebuilt like the layer's other saved tensors: tensors passed by
   keyword or inside a tuple (transformers' layers pass the hidden states by keyword) it would hold by reference
   for as long as the graph lives, a norm's output per layer for the whole step.
7. Under `recompute_attention` the attention block also runs one row of the micro-batch at a time (`by_row`), each
   row under its own checkpoint: rows attend only to themselves (a packed row's sequences, a padded row's tokens),
   so every row's values are the whole block's, exactly. What this bounds is the attention's working set, which is
   not saved and so not bounded by decision 6: under activation checkpointing the recomputed layer runs its attention
   forward again to rebuild the MLP's input, and its queries, the rotary embedding's temporaries (`q * cos`,
   `rotate_half(q)`, its product with `sin`: about four `[N, E]` at once) and the output exist then beside the
   step's gradients; at 2 rows of 16k tokens that was the step's peak (benchmarks/RESULTS.md). One row at a time they
   are one row's, and so are the tensors the attention's own backward rebuilds. Only where it is plainly a batch:
   hidden states `[R, W, E]` with `R > 1`, no KV cache, no flash-attention varlen arguments (one packed row there
   anyway), and every tensor argument of two or more dimensions either per row (`R` leading, and nowhere else) or
   broadcast (1 leading); otherwise the block runs whole (`_rows_of`). Not under ZeRO-3 either: each call of the
   block's projections gathers their partitioned parameters, and processes whose micro-batches pack into
   different numbers of rows would gather different numbers of times.
8. Every replacement is this thread's alone (`modeling.swaps`): an asynchronous producer thread runs the same
   modules while the step trains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from grpo_trainer.modeling.recompute import transient_saves
from grpo_trainer.modeling.swaps import base_forward, installed, patched, swapped

__all__ = ["TiledMLP", "installed", "tiled_layers", "tiled_mlp"]


class TiledMLP(torch.autograd.Function):
    """`forward(x)` of a per-token module, `tokens` rows of `x.view(-1, E)` at a time, or in `count` tiles of at
    most that many where the processes agreed on one (ZeRO-3). The gradients of `parameters` are returned, those of
    `accumulated` (ZeRO-3's partitioned ones) accumulated into `.grad` by the backward (decision 1). `rebuild`:
    `(norm, source)` where `x` is a tiled norm's output `norm(source)`: `source` is kept instead of `x`, and each
    tile of `x` rebuilt from it in the backward (decision 5)."""

    @staticmethod
    def forward(ctx, forward: Callable[[Tensor], Tensor], tokens: int, count: int | None,
                accumulated: tuple[Tensor, ...], rebuild: tuple[Callable[[Tensor], Tensor], Tensor] | None,
                x: Tensor, *parameters: Tensor) -> Tensor:
        ctx.forward, ctx.tokens, ctx.count = forward, tokens, count
        ctx.parameters, ctx.accumulated = parameters, accumulated  # leaves, kept as is
        device = x.device.type  # the backward recomputes under the forward's autocast, as checkpointing does
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.rebuild, ctx.x_meta = (None, None) if rebuild is None else (rebuild[0], (x.shape, x.dtype))
        ctx.save_for_backward(x if rebuild is None else rebuild[1])
        flat = x.reshape(-1, x.shape[-1])  # [B*N, E]
        with torch.no_grad():
            out = _joined(forward, _tiles(flat, tokens, count), len(flat))  # [B*N, E']
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors  # or the norm's input it is rebuilt from
        shape, x_dtype = ctx.x_meta or (x.shape, x.dtype)
        parameters = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[6:], strict=True) if needed]
        flat, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        x_grad = flat.new_empty((len(flat), shape[-1]), dtype=x_dtype) if ctx.needs_input_grad[5] else None
        sums: list[Tensor | None] = [None] * len(parameters)
        tiles = _tiles(flat, ctx.tokens, ctx.count)
        start = 0
        device, enabled, dtype = ctx.autocast
        for i, (tile, tile_grad) in enumerate(zip(tiles, _tiles(grads, ctx.tokens, ctx.count), strict=True)):
            if ctx.rebuild is not None:  # this tile of the norm's output, from its input (decision 5)
                with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    tile = ctx.rebuild(tile)
            tile = tile.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), transient_saves():
                out = ctx.forward(tile)
            wrt = ([tile] if x_grad is not None else []) + parameters
            if ctx.accumulated:  # ZeRO-3: ZeRO's hook reduces a gradient when told it is complete, at the last tile
                for p in ctx.accumulated:
                    p.ds_grad_is_ready = i == len(tiles) - 1
                torch.autograd.backward(out, tile_grad, inputs=[*wrt, *ctx.accumulated])
                found = tuple(t.grad for t in wrt)  # no parameters here: all of them are `accumulated`
            else:
                found = torch.autograd.grad(out, wrt, tile_grad, allow_unused=True) if wrt else ()
            if x_grad is not None:
                x_grad[start:start + len(tile)] = found[0]
                found = found[1:]
            sums = [s if g is None else (g if s is None else s.add_(g)) for s, g in zip(sums, found, strict=True)]
            start += len(tile)
        it = iter(sums)
        parameter_grads = [next(it) if needed else None for needed in ctx.needs_input_grad[6:]]
        return (None, None, None, None, None, None if x_grad is None else x_grad.view(shape), *parameter_grads)


def _tiles(flat: Tensor, tokens: int, count: int | None) -> tuple[Tensor, ...]:
    """`flat`'s rows in tiles of at most `tokens`: as many as it takes, or `count` (some possibly empty)."""
    return flat.split(tokens) if count is None else flat.tensor_split(count)


def _joined(forward: Callable[[Tensor], Tensor], tiles: tuple[Tensor, ...], rows: int) -> Tensor:
    """`forward` of each tile written into one `[rows, E']` output as it comes: one tile's output beside the whole,
    not every tile's and then their concatenation (a second copy of the output)."""
    out, start = None, 0
    for tile in tiles:
        y = forward(tile)
        if out is None:
            out = y.new_empty((rows, y.shape[-1]))
        out[start:start + len(tile)] = y
        start += len(tile)
    assert out is not None and start == rows
    return out


def _partitioned(module: nn.Module) -> list[Tensor]:
    """The module's ZeRO-3 partitioned parameters (DeepSpeed gives each a `ds_id`), trained or not."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def _agreed_count(rows: int, tokens: int, partitioned: list[Tensor], device: torch.device) -> int:
    """The number of tiles every process of the ZeRO-3 partition group runs for this call: enough tiles of at most
    `tokens` rows for the largest of their micro-batches (`rows` here), so that each process calls the MLP's
    submodules, which gather their parameters, as often as the others (decision 1)."""
    count = torch.tensor([-(-rows // tokens)], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=partitioned[0].ds_process_group)
    return int(count.item())


_REBUILD = "_grpo_trainer_rebuild"  # on a tiled norm's output: (the norm's forward, its input), decision 5


def tiled_mlp(module: nn.Module, forward: Callable[[Tensor], Tensor], tokens: int, norm: bool = False
              ) -> Callable[[Tensor], Tensor]:
    """A forward for `module` that runs `forward` (its own) through `TiledMLP`, `tokens` tokens per tile. `norm`:
    its output says how to rebuild it from its input, for the next tiled module to keep that instead (decision 5)."""

    def run(x: Tensor) -> Tensor:
        # Read at each call: under FSDP2 the unsharded parameters the forward computes with (decision 1).
        parameters = tuple(p for p in module.parameters() if p.requires_grad)
        partitioned = _partitioned(module)
        rows = x.numel() // x.shape[-1]
        count = _agreed_count(rows, tokens, partitioned, x.device) if partitioned else None
        if not torch.is_grad_enabled():  # no graph to keep: tiles bound the transient all the same
            out = _joined(forward, _tiles(x.reshape(rows, x.shape[-1]), tokens, count), rows)
            return out.view(*x.shape[:-1], out.shape[-1])
        rebuild = getattr(x, _REBUILD, None)  # x is a tiled norm's output: keep the norm's input instead
        if rebuild is not None and rebuild[1].shape[:-1] != x.shape[:-1]:
            rebuild = None
        if partitioned:  # every trained parameter's gradient accumulated by the backward itself (decision 1)
            out = TiledMLP.apply(forward, tokens, count, parameters, rebuild, x)
        else:
            out = TiledMLP.apply(forward, tokens, None, (), rebuild, x, *parameters)
        if norm:
            setattr(out, _REBUILD, (forward, x))
        return out

    return run


def _per_token(mlp: nn.Module) -> bool:
    """Decision 2: a dense MLP (no router, no experts)."""
    return not any(hasattr(mlp, name) for name in ("router", "gate_network", "experts", "num_experts"))


def _is_norm(module: nn.Module) -> bool:
    """Decision 6: a normalisation over the last dimension (`nn.LayerNorm`, a model's `...RMSNorm`) with nothing
    inside it, whose parameters are not ZeRO-3 partitioned (its own forward, called without its module's hooks,
    would not gather them)."""
    norm = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")
    return norm and not any(True for _ in module.children()) and not _partitioned(module)


def _norms(layer: nn.Module) -> list[nn.Module]:
    """Decision 6: a decoder layer's norms: its own children's, and its attention's (per-head q/k norms)."""
    attention = getattr(layer, "self_attn", None)
    children = [*layer.children(), *(attention.children() if attention is not None else ())]
    return [module for module in children if _is_norm(module)]


def _tiled_modules(layer: nn.Module) -> list[nn.Module]:
    """What `tiled_layers` tiles in a decoder layer: its per-token MLP (decisions 1-2) and its norms (decision 5)."""
    mlp = getattr(layer, "mlp", None)
    return ([mlp] if mlp is not None and _per_token(mlp) else []) + _norms(layer)


@contextlib.contextmanager
def _all_installed(replaced: list[tuple[nn.Module, Callable[..., object]]]) -> Iterator[None]:
    """Each module's forward is its replacement within this context (`installed`, nested alike)."""
    with contextlib.ExitStack() as stack:
        for module, forward in replaced:
            stack.enter_context(installed(module, forward))
        yield


def _checkpointed(checkpoint: Callable[..., object], replaced: list[tuple[nn.Module, Callable[..., object]]]
                  ) -> Callable[..., object]:
    """A layer's `_gradient_checkpointing_func` whose checkpointed function (run in the forward, and again in the
    backward's recomputation) computes with the `replaced` modules' tiled forwards (decision 3)."""

    def run(function: Callable[..., object], *args: object, **kwargs: object) -> object:
        def tiled(*inner_args: object, **inner_kwargs: object) -> object:
            with _all_installed(replaced):
                return function(*inner_args, **inner_kwargs)

        return checkpoint(tiled, *args, **kwargs)

    return run


def _draws_random(module: nn.Module) -> bool:
    """Whether `module`'s forward draws random numbers now: a dropout in training mode, as a submodule or as an
    attention's own rate (`attention_dropout`, Llama family)."""
    if not module.training:
        return False
    rate = getattr(module, "attention_dropout", 0.0)
    return bool(rate and float(rate) > 0) or any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def _recomputed(forward: Callable[..., object], inner: list[tuple[nn.Module, Callable[[Tensor], Tensor]]],
                by_row: bool = True, *, attention: nn.Module) -> Callable[..., object]:
    """An attention block's forward under its own (non-reentrant) checkpoint (decision 6), one row at a time where
    the call is plainly a batch (decision 7): it keeps its inputs and recomputes the rest in its backward, with its
    tiled children (`inner`) installed there as in the forward, so the recomputation saves what the forward did.
    `attention`: the module, whose dropout decides whether the checkpoint keeps torch's RNG state."""

    def one(*args: object, **kwargs: object) -> object:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Every tensor goes to the checkpoint as a positional input, which it saves as a saved tensor: inside a
        # checkpointed layer that is what the layer's checkpoint discards and rebuilds. A keyword argument (the
        # hidden states, as transformers' layers pass them) or a tensor inside a tuple (cos / sin) it would keep by
        # reference instead, for as long as the graph lives: one norm output `[N, E]` per layer (decision 6).
        tensors: list[Tensor] = []
        template = _lifted((args, kwargs), tensors)

        def checkpointed_attention(*inputs: Tensor) -> object:
            call_args, call_kwargs = _filled(template, inputs)
            with _all_installed(inner):
                return forward(*call_args, **call_kwargs)

        # torch's default preserve_rng_state stashes the CPU generator in the forward and sets it back around the
        # backward's recomputation: the process-wide generator, which an asynchronous producer thread may be drawing
        # from right then (`trainer.producer`, decision 3). Only an attention that draws (dropout) needs it.
        return torch.utils.checkpoint.checkpoint(checkpointed_attention, *tensors, use_reentrant=False,
                                                 preserve_rng_state=_draws_random(attention))

    def run(*args: object, **kwargs: object) -> object:
        rows = _rows_of(args, kwargs) if by_row else 1
        if rows < 2:
            return one(*args, **kwargs)
        return _joined_rows([one(*_row(args, r, rows), **_row(kwargs, r, rows)) for r in range(rows)])

    return run


@dataclass(frozen=True)
class _Slot:
    """Where `_lifted` took a tensor out: its index among the lifted tensors."""

    index: int


def _mapped(value: object, function: Callable[[Any], object], leaf: type = Tensor) -> object:
    """`value` with `function` applied to each `leaf` in it, in tuples, named tuples, lists and dicts alike."""
    if isinstance(value, leaf):
        return function(value)
    if isinstance(value, (tuple, list)):
        items = [_mapped(item, function, leaf) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _mapped(item, function, leaf) for key, item in value.items()}
    return value


def _lifted(value: object, tensors: list[Tensor]) -> object:
    """`value` with each tensor appended to `tensors` and replaced by its `_Slot`."""
    return _mapped(value, lambda tensor: tensors.append(tensor) or _Slot(len(tensors) - 1))


def _filled(template: object, tensors: tuple[Tensor, ...]) -> object:
    """`_lifted`'s template with each `_Slot` replaced by its tensor from `tensors`."""
    return _mapped(template, lambda slot: tensors[slot.index], leaf=_Slot)


_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")  # flash-attention's packed arguments


def _rows_of(args: tuple[object, ...], kwargs: dict[str, object]) -> int:
    """`R`, the rows an attention call can run one at a time (decision 7), or 1 where it runs whole."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[0] < 2:
        return 1
    rows = hidden.shape[0]
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values", *_VARLEN)):
        return 1
    mask = kwargs.get("attention_mask")
    if mask is not None and not isinstance(mask, Tensor):  # flex attention's BlockMask, a dict of masks, ...
        return 1
    shapes: list[torch.Size] = []
    _mapped((args, kwargs), lambda t: t.dim() >= 2 and shapes.append(t.shape))
    if any(shape[0] not in (1, rows) for shape in shapes):
        return 1
    # R leading and again further in: a per-row tensor, or one whose leading dimension only happens to equal R
    # (Qwen2-VL's multimodal position ids `[3, R, W]` at R = 3): not told apart, so the block runs whole
    return 1 if any(shape[0] == rows and rows in shape[1:] for shape in shapes) else rows


def _row(value: object, r: int, rows: int) -> object:
    """Row `r` of `value`: of each tensor of two or more dimensions with `rows` leading, in containers alike;
    everything else (broadcast tensors, positions `[W]`, flags) as is."""
    return _mapped(value, lambda t: t[r:r + 1] if t.dim() >= 2 and t.shape[0] == rows else t)


def _joined_rows(outputs: list[object]) -> object:
    """The rows' outputs of one call, joined along the rows: a tensor, or a tuple of tensors and Nones."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs)  # type: ignore[arg-type]
    return type(first)(None if parts[0] is None else torch.cat(parts)  # type: ignore[call-arg]
                       for parts in zip(*outputs, strict=True))


def _replacements(layer: nn.Module, tokens: int, recompute_attention: bool
                  ) -> list[tuple[nn.Module, Callable[..., object]]]:
    """A decoder layer's modules and the forwards `tiled_layers` gives them (decisions 1, 5, 6)."""
    replaced = [(m, tiled_mlp(m, base_forward(m), tokens, norm=_is_norm(m))) for m in _tiled_modules(layer)
                if not patched(m)] if tokens > 0 else []
    attention = getattr(layer, "self_attn", None)
    if recompute_attention and attention is not None and not patched(attention):
        children = set(attention.children())
        inner = [(m, f) for m, f in replaced if m in children]
        replaced.append((attention, _recomputed(base_forward(attention), inner, by_row=not _partitioned(attention),
                                                attention=attention)))
    return replaced


@contextlib.contextmanager
def tiled_layers(lm: nn.Module, tokens: int, recompute_attention: bool = False) -> Iterator[None]:
    """Within this context each decoder layer's per-token MLP and norms of the causal LM `lm` (and its final norm)
    compute `tokens` tokens at a time (`TiledMLP`; 0: as is), with `recompute_attention` each layer's attention
    block runs under its own checkpoint, and a checkpointed layer recomputes them so in the backward (decisions 3,
    5, 6)."""
    if tokens <= 0 and not recompute_attention:
        yield
        return
    decoder = lm.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None) or ()  # Llama family; GPT-2
    final = [m for m in (getattr(decoder, "norm", None), getattr(decoder, "ln_f", None))  # Llama family; GPT-2
             if m is not None and _is_norm(m)] if tokens > 0 else []
    with contextlib.ExitStack() as stack:
        for module in final:
            if not patched(module):
                stack.enter_context(installed(module, tiled_mlp(module, base_forward(module), tokens)))
        for layer in layers:
            replaced = _replacements(layer, tokens, recompute_attention)
            stack.enter_context(_all_installed(replaced))
            if getattr(layer, "_gradient_checkpointing_func", None) is not None and replaced:
                stack.enter_context(swapped(layer, "_gradient_checkpointing_func",
                                            lambda checkpoint, replaced=replaced: _checkpointed(checkpoint, replaced)))
        yield
