"""On-policy replay of what the rollout computed, in the policy's loss forward and backward.

With activation checkpointing, the loss forward runs every decoder layer once without a graph, only to get each
layer's input for the backward pass, which runs the layer again with a graph. On-policy (no optimizer step since the
rollout) the fast rollout backend (`rollout.fast`) has already computed every layer's output at every position,
under the same weights: prefill for the prompt, one decode step per completion token. `replayed_layers` makes each
checkpointed layer return that output instead of computing it; its backward recomputes the layer from its input
exactly as checkpointing does. The forward's cost drops to the embedding, masks, rotary tables and final norm.

What changes is only the point at which the backward linearises each layer: the rollout's states instead of a full-
sequence forward's, equal up to float rounding (a KV-cache decode sums attention in another order). Positions the
loss never reads (left padding, after EOS, the last token, which the rollout never fed back) hold whatever the
rollout left there, zeros for the last token: their gradient is exactly zero, as it is without replay.

The LM head gets the same treatment in `modeling.logprobs`: on-policy its forward returns the rollout's log-probs,
and its backward takes the rollout's tempered softmax (`ReplayCapture.probs`) instead of recomputing the logits.
Both kinds of tensors are kept only within the memory budget that `capture` applies.

Shapes: `B` rows, `L` decoder layers, `N` = S + T columns (prompt then completion), `E` hidden size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling.recompute import transient_saves
from grpo_trainer.modeling.swaps import swapped

__all__ = ["replayed_layers"]


class _Replayed(torch.autograd.Function):
    """Forward: return `known` (the layer's output, computed by the rollout). Backward: run `layer` on the saved
    input with a graph and backpropagate through it, as non-reentrant checkpointing's recompute does; parameter
    gradients accumulate into `.grad` there, the input's is returned."""

    @staticmethod
    def forward(ctx, layer: Callable[[Tensor], Tensor], hidden: Tensor, known: Tensor) -> Tensor:
        ctx.layer = layer
        ctx.save_for_backward(hidden)
        return known.clone()  # a tensor of its own: later layers may keep it or write to it

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[None, Tensor | None, None]:
        (hidden,) = ctx.saved_tensors
        x = hidden.detach().requires_grad_(ctx.needs_input_grad[1])
        with torch.enable_grad(), transient_saves():  # the layer's saves: this backward's own (`modeling.recompute`)
            out = ctx.layer(x)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward(out, grad_output)
        return None, x.grad, None


def _replay(known: Tensor, checkpoint: Callable[..., Any], layout: tuple[Tensor, Tensor] | None
            ) -> Callable[..., Any]:
    """A stand-in for a layer's `_gradient_checkpointing_func(function, hidden_states)`; `known` `[B, N, E]`, read
    at `layout` (see `replayed_layers`) when given."""
    shape = known.shape if layout is None else (*layout[0].shape, known.shape[-1])

    def run(function: Callable[[Tensor], Tensor], hidden: Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or hidden.shape != shape or torch.is_autocast_enabled(hidden.device.type):
            return checkpoint(function, hidden, *args, **kwargs)  # not the call this was made for: plain path
        # A frozen embedding (LoRA) gives an input without grad; the layer's parameters still need the backward.
        hidden = hidden if hidden.requires_grad else hidden.detach().requires_grad_()
        values = known if layout is None else known[layout]  # packed: [R, W, E] gathered from [B, N, E]
        return _Replayed.apply(function, hidden, values.to(hidden.dtype))

    return run


@contextlib.contextmanager
def replayed_layers(layers: nn.ModuleList, outputs: Tensor, layout: tuple[Tensor, Tensor] | None = None
                    ) -> Iterator[None]:
    """Within this context each checkpointed layer of `layers` returns `outputs[:, l]` (`[B, L, N, E]`, the
    rows and columns of the input about to run) instead of computing it. Layers that are not checkpointed (no
    activation checkpointing, or eval mode) compute as usual.

    `layout` = (rows `[R, W]`, columns `[R, W]`): the forward runs on another arrangement of the same tokens (a
    packed forward, `modeling.packing`), whose position (r, w) holds the token at (rows[r, w], columns[r, w]) of
    `outputs`; each layer's output is gathered into it (a copy per layer, as the unpacked path's clone)."""
    with contextlib.ExitStack() as stack:
        for index, layer in enumerate(layers):
            if getattr(layer, "_gradient_checkpointing_func", None) is not None:
                stack.enter_context(swapped(layer, "_gradient_checkpointing_func", lambda checkpoint, i=index:
                                            _replay(outputs[:, i], checkpoint, layout)))
        yield
