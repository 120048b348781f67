"""A tied input embedding's gradient without a `[V, E]` buffer of its own: the lookup's rows added in place into
the LM head's gradient.

Decisions:

1. With tied embeddings (Qwen2.5 0.5B-3B, Qwen3 0.6B-4B, Llama 3.2 1B/3B) the one `[V, E]` matrix gets two
   gradients in a backward: the LM head's, dense (every row of the vocabulary has a logit), and the input lookup's,
   which touches only the rows of the micro-batch's tokens. PyTorch's embedding backward builds the latter as a zero
   `[V, E]` matrix with those rows added, which autograd then adds to the head's: one more matrix of the
   vocabulary's size at the backward's end, beside the head's gradient and the optimizer state. Once activations
   are bounded (checkpointed, tiled) that transient is where a step's memory peaks (per-phase trace in
   `benchmarks/RESULTS.md`: 519 MiB at the 2-layer Qwen2.5-0.5B proxy's 151,936 x 896 float32 matrix).
2. The lookup runs as `TiedLookup`, whose backward adds the `n` rows' gradients into the head's `[V, E]` gradient in
   place (`index_add_`, the sum the dense backward does) and returns none for the matrix: autograd accumulates the
   head's gradient, now holding both, into `.grad` as before, so clipping, the optimizer, DDP's and DeepSpeed's
   gradient hooks see what they always saw (equal within float32 rounding: the same sums in another order; on CUDA
   `index_add_` sums a repeated token's rows with atomics, in a fixed order under torch's deterministic mode,
   `full_determinism`). The head (`logprobs._HeadLogProbs`) hands its gradient over through a `Link` that the lookup
   registered for the matrix during the forward (`claim`). Autograd orders the two: the lookup's backward needs the
   first layer's input gradient, which needs the head's backward; the leaf's accumulation waits for both. A
   `sparse=True` lookup would not do: autograd adds a sparse gradient to a custom function's returned one out of
   place (a new `[V, E]` tensor: with it the backward's peak did not move, measured while building this).
3. Where the head's gradient was not handed over (the model's own logits scored, a head that does not train), the
   lookup's backward returns the dense gradient as `nn.Embedding`'s does.
4. Only where this is certain to be the same sum: the embedding is a plain `nn.Embedding` lookup (no `max_norm`,
   `scale_grad_by_freq` or `sparse`; a subclass's forward, such as Gemma's scaled one, is left alone), its matrix is
   the LM head's (tied), trained and a plain tensor (not a ZeRO-3 or FSDP shard, whose gathers and reductions are
   their own). An untied or frozen (LoRA) embedding is left as is.
5. Installed around the training forwards and their scoring (`modeling.forwards`, `modeling.sequence_parallel`),
   like the tiled MLP, and removed after: generation and everyone else see the module as loaded. A link is
   claimable only within the context that made it, so a head outside it never receives another forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_trainer.modeling import swaps

__all__ = ["Link", "TiedLookup", "claim", "plain_lookup", "lookup_applies", "tied_lookup"]

# id(matrix) -> the link of its lookup in the open context (decision 5); the context holds the matrix meanwhile.
_open: dict[int, Link] = {}


class Link:
    """One lookup's handle on the head's gradient of the same matrix: the head `give`s it, the lookup `take`s it."""

    def __init__(self) -> None:
        self.looked_up = False
        self._gradient: Tensor | None = None

    def give(self, gradient: Tensor) -> None:
        self._gradient = gradient

    def take(self) -> Tensor | None:
        gradient, self._gradient = self._gradient, None
        return gradient


def claim(weight: Tensor) -> Link | None:
    """The link of the lookup that ran on `weight` in the open context, once (for the head's forward)."""
    link = _open.get(id(weight))
    if link is None or not link.looked_up:
        return None
    del _open[id(weight)]
    return link


class TiedLookup(torch.autograd.Function):
    """`weight[ids]` (`nn.Embedding`'s lookup, `padding_idx` rows without gradient) whose matrix gradient goes into
    the head's through `link` (decision 2), or is returned dense (decision 3)."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None, link: Link) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.link, ctx.matrix = padding_idx, link, (weight.shape, weight.dtype, weight.device)
        link.looked_up = True
        return nn.functional.embedding(ids, weight, padding_idx)  # [..., E]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor | None, None, None]:
        (ids,) = ctx.saved_tensors
        rows, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])  # [n], [n, E]
        if ctx.padding_idx is not None:
            grad = grad.masked_fill((rows == ctx.padding_idx)[:, None], 0.0)
        head = ctx.link.take()
        if head is not None:
            head.index_add_(0, rows, grad.to(head.dtype))
            return None, None, None, None
        shape, dtype, device = ctx.matrix
        return None, torch.zeros(shape, dtype=dtype, device=device).index_add_(0, rows, grad.to(dtype)), None, None


def plain_lookup(embedding: nn.Module | None) -> bool:
    """Decision 4's lookup: `nn.Embedding`'s own forward, without `max_norm`, `scale_grad_by_freq` or `sparse`."""
    return isinstance(embedding, nn.Embedding) and type(embedding).forward is nn.Embedding.forward \
        and embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse


def lookup_applies(lm: nn.Module) -> bool:
    """Decision 4: `lm`'s input embedding is a plain `nn.Embedding` lookup sharing its trained, unsharded matrix
    with the LM head."""
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if not plain_lookup(embedding):
        return False
    weight = embedding.weight
    return getattr(head, "weight", None) is weight and weight.requires_grad \
        and type(weight.data) is torch.Tensor and not hasattr(weight, "ds_id")


@contextlib.contextmanager
def tied_lookup(lm: nn.Module) -> Iterator[None]:
    """Within this context `lm`'s tied input embedding looks up through `TiedLookup`, and the LM head's gradient of
    the same matrix can be `claim`ed once (decision 5); where decision 4 does not hold, or without gradients, as
    is."""
    embedding = lm.get_input_embeddings()
    if not torch.is_grad_enabled() or swaps.patched(embedding) or not lookup_applies(lm):
        yield
        return
    weight, link = embedding.weight, Link()

    def lookup(ids: Tensor) -> Tensor:
        return TiedLookup.apply(ids, weight, embedding.padding_idx, link)

    _open[id(weight)] = link
    try:
        with swaps.installed(embedding, lookup):
            yield
    finally:
        _open.pop(id(weight), None)
