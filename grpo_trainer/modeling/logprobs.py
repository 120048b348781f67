"""Per-token log-probabilities (and entropies) of completion tokens under a causal LM, memory-lean.

A naive `log_softmax(model(x).logits)` holds float32 `[B, S+T, V]` logits, which for a 32k-152k vocabulary
dominates the step's memory. Here the model runs with `logits_to_keep=1` and returns its final hidden states;
only the `T` completion positions are projected through the LM head, `chunk_size` rows at a time, each chunk
upcast to float32 on its own. With gradients on, each chunk is recomputed in the backward pass, so no `[B, T, V]`
tensor is ever kept: peak extra memory is one chunk's logits, which `LOGITS_CHUNK_BYTES` also bounds (at a 152k
vocabulary 1024 rows of float32 logits are 622 MB).

For a plain `nn.Linear` head (the usual case) one autograd function (`_HeadLogProbs`) does all chunks: the
forward keeps only each row's log-sum-exp, and the backward rebuilds a chunk's logits and writes the gradient of
log p(token) = z_token - logsumexp(z) in place, `dz = g * (onehot(token) - softmax(z))`, then projects it through
the head. That is two V-wide passes per chunk in the backward instead of autograd's replay of the whole
softmax/gather graph. The entropy H is differentiable too (for the entropy bonus): dH/dz = -p * (log p + H),
a few more V-wide passes per chunk, paid only when a loss uses H. On-policy the rollout's values stand in
(`known`): the forward projects nothing, and with the rollout's softmax (`replay`) the backward skips recomputing
the logits: per chunk one V-wide product instead of two for a frozen head (LoRA), two instead of three for a
trained one. Any other head (a wrapped,
sharded or offloaded module) goes through `torch.utils.checkpoint` around `token_logprobs`, which calls the module
and so keeps its hooks.

A `Float32Head` (`cast_lm_head_to_fp32`) is a plain head too: its float32 weight multiplies the hidden states cast
to float32, with autocast off, in the chunked path as in its own forward (generation). A Mixture-of-Experts model
asked for its router's load-balancing loss (`with_aux_loss`) returns it from the same forward; the result is one
typed `LogProbs`, whatever was asked for.

Truncated sampling (top-k / top-p / min-p, `modeling.support`): each token is scored with a softmax over the tokens
the sampler could draw at its position (the rest of the vocabulary masked to -inf before the softmax, in the forward
and in the recomputing backward alike), and the log of the probability mass those tokens hold under the full
softmax is returned with the log-probs (`LogProbs.log_kept_mass`, not differentiated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_trainer.algorithms.truncation import pack
from grpo_trainer.modeling import tied_embedding
from grpo_trainer.modeling.support import KeptSupport
from grpo_trainer.modeling.unwrap import causal_lm, output_head

logger = logging.getLogger(__name__)

__all__ = ["LOGITS_CHUNK_BYTES", "Float32Head", "Known", "LogProbs", "ScoringHead", "chunk_rows", "chunked_scores",
           "completion_logprobs", "head_runs_inside_forward", "logits_scores", "scoring_head",
           "token_logprobs"]

# Values computed under the loss's weights before its forward (the rollout's, on-policy), for the N scored rows:
# log-probs [N], entropies [N] or None, the tempered softmax ([N, V], or [B, T, V] read at the index) or None, and
# that index (rows [N], columns [N]) or None. See `_HeadLogProbs`.
Known = tuple[Tensor, Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]

# The most float32 logits one chunk may hold: fewer rows per chunk where the vocabulary is large.
LOGITS_CHUNK_BYTES = 2**27


def chunk_rows(chunk_size: int, vocab_size: int) -> int:
    """Rows per LM-head chunk: `chunk_size`, or fewer where `[rows, V]` float32 logits would pass
    `LOGITS_CHUNK_BYTES` (e.g. 220 rows at V = 151,936 instead of 1024), never fewer than 1."""
    return max(1, min(chunk_size, LOGITS_CHUNK_BYTES // (4 * vocab_size)))


@dataclass(frozen=True)
class LogProbs:
    """What `completion_logprobs` computed for `B` completions of `T` tokens."""

    logps: Tensor  # [B, T] float32 log pi(token)
    entropy: Tensor | None = None  # [B, T] float32 entropy of each position's distribution (with_entropy)
    aux_loss: Tensor | None = None  # [] the MoE router's load-balancing loss, differentiable (with_aux_loss)
    # With a truncating `support`: log of the full softmax's mass on the kept tokens `[B, T]` (None where the
    # forward projected nothing: the rollout's values stood in), and with `support.collect` the supports used,
    # packed `[B, T, W]`.
    log_kept_mass: Tensor | None = None
    sampling_mask: Tensor | None = None


class Float32Head(nn.Linear):
    """An LM head whose weight is float32 and which computes in float32 whatever its input's dtype, autocast
    included (ScaleRL's float32 head: logits of a bf16 model without bf16 rounding)."""

    def forward(self, hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(hidden.float(), self.weight.float(), bias)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of `tokens` and entropy of each row's distribution, in float32.

    Args: logits `[N, V]` (any float dtype), tokens `[N]`. Returns two `[N]` tensors.
    """
    logits = logits.float() / temperature
    logsumexp = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logsumexp
    probs = torch.softmax(logits, dim=-1)
    entropy = logsumexp - (probs * logits).sum(-1)
    return chosen, entropy


def _supported_scores(logits: Tensor, tokens: Tensor, temperature: float, support: KeptSupport | None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`token_logprobs` over each row's kept support (module docstring): log-probs, entropies, log kept masses
    `[N]` (empty without a support) and the packed supports `[N, W]` (empty unless collected)."""
    if support is None:
        chosen, entropy = token_logprobs(logits, tokens, temperature)
        return chosen, entropy, chosen.new_empty(0), tokens.new_empty(0, dtype=torch.uint8)
    z = logits.float() / temperature  # [N, V]
    kept = support.mask(z.detach(), tokens, slice(None))
    full = torch.logsumexp(z.detach(), dim=-1)
    masked = z.masked_fill(~kept, -torch.inf)
    mass = torch.logsumexp(masked.detach(), dim=-1) - full
    log_p = torch.log_softmax(masked if support.renormalise else z, dim=-1)
    chosen = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    finite = log_p.masked_fill(~kept, 0.0) if support.renormalise else log_p  # 0 log 0 = 0 off the support
    entropy = -(log_p.exp() * finite).sum(-1)
    return chosen, entropy, mass, pack(kept) if support.collect else tokens.new_empty(0, dtype=torch.uint8)


def _head_logprobs(head: nn.Module, hidden: Tensor, tokens: Tensor, temperature: float,
                   support: KeptSupport | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _supported_scores(head(hidden), tokens, temperature, support)


def chunked_scores(score: Callable[..., tuple[Tensor, ...]], rows: Tensor, tokens: Tensor, temperature: float,
                   chunk_size: int, support: KeptSupport | None = None) -> tuple[Tensor, ...]:
    """`score(rows, tokens, temperature, support)` (`_supported_scores` on logits, or a head's scorer on hidden
    states) over chunks of `chunk_size` rows `[N, *]`, `[N]`; each chunk recomputed in the backward pass when
    differentiable, so only one chunk's float32 logits are alive at a time. Log-probs and entropies `[N]` (both
    differentiable: the entropy bonus trains through them), then the log kept masses `[N]` and packed supports
    `[N, W]` (empty without a support)."""
    outputs: list[list[Tensor]] = [[], [], [], []]
    for start in range(0, tokens.numel(), chunk_size):
        index = slice(start, start + chunk_size)
        args = (rows[index], tokens[index], temperature, None if support is None else support.rows(index))
        if torch.is_grad_enabled() and rows.requires_grad:
            # no randomness to replay: leave torch's generator alone (a producer thread may be drawing from it)
            values = checkpoint(score, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            values = score(*args)
        for collected, value in zip(outputs, values):
            collected.append(value)
    return tuple(torch.cat(collected) for collected in outputs)


def _takes(lm: nn.Module, name: str) -> bool:
    """Whether `lm`'s forward takes keyword `name` (by name or through `**kwargs`)."""
    parameters = inspect.signature(lm.forward).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def logits_scores(logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies `[N]` float32 of `tokens` `[N]` under a model's own `logits` `[N, V]` (any dtype),
    `chunk_rows` rows at a time, so one float32 chunk is alive at a time (recomputed in the backward)."""
    logps, entropies, _, _ = chunked_scores(_supported_scores, logits, tokens, temperature,
                                            chunk_rows(chunk_size, logits.shape[-1]))
    return logps, entropies


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = nn.functional.linear(hidden, weight, bias).float()  # [n, V], a buffer of its own
    return logits if temperature == 1.0 else logits.div_(temperature)


def _logsumexp_(logits: Tensor) -> Tensor:
    """log sum exp over the last dim of `logits` `[n, V]`, computed in place (`logits` is overwritten): unlike
    `torch.logsumexp` or `log_softmax`, no second `[n, V]` buffer, so a chunk's peak memory is its logits alone
    (120-200 MB less peak RSS with a 32k vocabulary and beta > 0 in `benchmarks/RESULTS.md`, where the reference
    forward runs while the rollout's replay tensors are held)."""
    top = logits.amax(dim=-1, keepdim=True)  # [n, 1]
    return logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


class _HeadLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T + bias) / temperature)[token] per row, and optionally the entropy, one chunk
    of rows at a time. Saves only the rows' log-sum-exp and entropies `[N]` besides its inputs. Both outputs are
    differentiable (the entropy for the entropy bonus); an output that no loss uses costs nothing in the backward.

    `known` = (logps `[N]`, entropies `[N]` or None, probs or None, probs_index or None): values already computed
    under the same weights (the rollout's, on-policy); the forward then projects nothing and returns them. The
    backward takes the tempered softmax from `probs` where given (one V-wide product per chunk fewer), else
    recomputes the logits and their softmax. `probs` is `[N, V]` (row r for row r), or `[B, T, V]` read at
    `probs_index` = (rows `[N]`, columns `[N]`): a packed forward's rows are a selection of the padded layout's,
    and gathering them per chunk spares a copy of the whole softmax."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                chunk_size: int, with_entropy: bool, known: Known | None = None, support: KeptSupport | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        N = tokens.shape[0]
        ctx.temperature, ctx.chunk_size, ctx.support = temperature, chunk_size, support
        # a tied input embedding's lookup adds its rows into this weight gradient (`modeling.tied_embedding`)
        ctx.link = tied_embedding.claim(weight) if ctx.needs_input_grad[1] else None
        ctx.probs_index = None if known is None else known[3]
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        masses, packed = hidden.new_empty(0, dtype=torch.float32), tokens.new_empty(0, dtype=torch.uint8)
        if known is not None:
            logps = known[0].to(torch.float32, copy=True)
            entropies = known[1].to(torch.float32, copy=True) if with_entropy else logps.new_empty(0)
            ctx.save_for_backward(hidden, weight, bias, tokens, None, known[2], entropies)
            ctx.mark_non_differentiable(masses, packed)
            return logps, entropies, masses, packed
        logps = hidden.new_empty(N, dtype=torch.float32)
        lses = torch.empty_like(logps)
        entropies = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        if support is not None:
            masses = torch.empty_like(logps)
            if support.collect:
                packed = tokens.new_empty(N, -(-weight.shape[0] // 8), dtype=torch.uint8)
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, bias, temperature)  # [n, V]
            kept, full = (None, None) if support is None else _chunk_support(logits, tokens, rows, support, masses,
                                                                            packed)
            chosen = logits.gather(-1, tokens[rows, None]).squeeze(-1)  # z_token [n]
            if with_entropy:  # H = -sum p log p needs log p and p side by side: a second [n, V] buffer
                log_p = torch.log_softmax(logits, dim=-1)
                del logits
                logps[rows] = log_p.gather(-1, tokens[rows, None]).squeeze(-1)
                lses[rows] = chosen - logps[rows]
                p = log_p.exp()
                if kept is not None:  # p = 0 off the support, where log p = -inf: their product is 0, not nan
                    log_p.masked_fill_(~kept, 0.0)
                entropies[rows] = -p.mul_(log_p).sum(dim=-1)  # in place: no third [n, V] buffer
                del p, log_p
            else:
                lses[rows] = _logsumexp_(logits)
                logps[rows] = chosen - lses[rows]
                del logits
            if kept is not None:
                masses[rows] = lses[rows] - full
            # This chunk's [n, V] buffers are gone before the next chunk's logits exist: with the entropy at most
            # two at a time (logits and log p, then log p and p), not four (the last chunk's p and log p beside).
            del kept, full
        ctx.save_for_backward(hidden, weight, bias, tokens, lses, None, entropies)
        ctx.mark_non_differentiable(masses, packed)
        return logps, entropies, masses, packed

    @staticmethod
    def backward(ctx, grad_logps: Tensor | None, grad_entropies: Tensor | None, *unused: Tensor | None):
        hidden, weight, bias, tokens, lses, known_probs, entropies = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias) if want_bias else None
        if grad_logps is None:
            grad_logps = tokens.new_zeros(tokens.shape, dtype=torch.float32)
        for start in range(0, tokens.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h, token = hidden[rows], tokens[rows]
            # z = logits / T and d log p(token) / dz = onehot(token) - softmax(z). The upstream gradient and the
            # 1/T scale the rows, so they are applied on the E-wide side of each product, never to a V-wide one.
            scale = (grad_logps[rows] / ctx.temperature).to(weight.dtype)[:, None]  # [n, 1]
            with_entropy_grad = grad_entropies is not None
            probs, log_probs = _chunk_softmax(h, weight, bias, ctx.temperature, lses, known_probs, ctx.probs_index,
                                              rows, with_log=with_entropy_grad, support=ctx.support, tokens=token)
            if with_entropy_grad:
                # dH/dz = -p * (log p + H): the vocab-side term is no longer a row scaling of p, so build it.
                g, g_h = grad_logps[rows, None], grad_entropies[rows, None]  # [n, 1] each
                dense = (probs * (g + g_h * entropies[rows, None]) + g_h * log_probs).div_(ctx.temperature)
                dense, dense_scale = dense.to(weight.dtype), None  # [n, V]: d loss / d logits, less the token term
            else:
                dense, dense_scale = probs.to(weight.dtype), scale
            if want_hidden and dense_scale is None:
                grad_hidden[rows] = scale * weight[token] - dense @ weight
            elif want_hidden:
                grad_hidden[rows] = scale * (weight[token] - dense @ weight)
            if want_weight or want_bias:
                scaled = scale * h  # [n, E]
            if want_weight:
                grad_weight.addmm_(dense.T, h if dense_scale is None else dense_scale * h, alpha=-1)
                grad_weight.index_add_(0, token, scaled)
            if want_bias:
                row_weights = torch.ones_like(scale[:, 0]) if dense_scale is None else dense_scale[:, 0]
                grad_bias.addmv_(dense.T, row_weights, alpha=-1).index_add_(0, token, scale[:, 0])
            del probs, log_probs, dense  # before the next chunk's softmax, as in the forward
        if ctx.link is not None and grad_weight is not None:
            ctx.link.give(grad_weight)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _chunk_support(logits: Tensor, tokens: Tensor, rows: slice, support: KeptSupport, masses: Tensor,
                   packed: Tensor) -> tuple[Tensor | None, Tensor]:
    """One chunk's kept support (module docstring) and its full softmax's log-sum-exp `[n]`: a renormalising
    support masks `logits` `[n, V]` in place and is returned `[n, V]` (the caller scores over it); otherwise the log
    kept mass goes to `masses[rows]` and the support is None (scored over the full softmax). Packed supports are
    written to `packed[rows]` when collected."""
    kept = support.mask(logits, tokens[rows], rows)  # [n, V]
    full = torch.logsumexp(logits, dim=-1)
    if support.collect:
        packed[rows] = pack(kept)
    if support.renormalise:
        logits.masked_fill_(~kept, -torch.inf)
        return kept, full
    masses[rows] = torch.logsumexp(logits.masked_fill(~kept, -torch.inf), dim=-1) - full
    return None, full


def _chunk_softmax(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, lses: Tensor | None,
                   known_probs: Tensor | None, probs_index: tuple[Tensor, Tensor] | None, rows: slice, with_log: bool,
                   support: KeptSupport | None = None, tokens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The tempered softmax `[n, V]` float32 of one chunk (over each row's kept support when `support`
    renormalises: the forward's mask, rebuilt from the same logits), from the rollout's (`known_probs`, read at
    `probs_index` when given), from the saved log-sum-exp, or recomputed; with `with_log` also p * log p `[n, V]`
    (0 where p = 0), for the entropy's gradient."""
    if known_probs is not None:
        chunk = known_probs[rows] if probs_index is None else known_probs[probs_index[0][rows], probs_index[1][rows]]
        if not with_log:
            return chunk, None
        probs = chunk.float()
        return probs, torch.special.xlogy(probs, probs)
    logits = _chunk_logits(h, weight, bias, temperature)  # [n, V]
    kept = None
    if support is not None and support.renormalise:
        kept = support.mask(logits, tokens, rows)
        logits.masked_fill_(~kept, -torch.inf)
    log_p = torch.log_softmax(logits, dim=-1) if lses is None else logits.sub_(lses[rows, None])
    if not with_log:
        return log_p.exp_(), None
    probs = log_p.exp()
    p_log_p = log_p.mul_(probs)
    return probs, p_log_p if kept is None else p_log_p.masked_fill_(~kept, 0.0)


def _is_plain_linear(head: nn.Module) -> bool:
    """A head whose weight can be used directly: no wrapper, hook, sharding (ZeRO-3, FSDP) or offloading."""
    weight = head.weight
    return (type(head) in (nn.Linear, Float32Head) and not hasattr(head, "_hf_hook") and not hasattr(weight, "ds_id")
            and type(weight.data) is torch.Tensor and not head._forward_hooks and not head._forward_pre_hooks)


@dataclass(frozen=True)
class LogitTransform:
    """What a causal LM does to its LM head's output before returning logits, read from its config: Cohere's
    `logit_scale` (multiply), Granite's and MiniCPM3's `logits_scaling` (divide), Gemma 2/3's
    `final_logit_softcapping` (cap * tanh(z / cap)). The loss must score the model's logits, not the head's."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None)
                                                                           or 1.0)
        return cls(scale, getattr(config, "final_logit_softcapping", None))

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        logits = logits if self.scale == 1.0 else logits * self.scale
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


class _TransformedHead(nn.Module):
    """`transform(head(x))`: a head whose output is post-processed, for the checkpointed per-chunk path."""

    def __init__(self, head: nn.Module, transform: LogitTransform) -> None:
        super().__init__()
        self.head, self.transform = head, transform

    def forward(self, hidden: Tensor) -> Tensor:
        return self.transform(self.head(hidden))


# Causal LMs whose returned logits were checked against transform(head(hidden)): model -> whether they matched.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _head_reproduces_logits(lm: nn.Module, logits: Tensor, last_hidden: Tensor, head: nn.Module,
                            transform: LogitTransform) -> bool:
    """Once per model: do the model's own last-position logits `[B, V]` equal transform(head(hidden))? A model
    that post-processes its logits in a way `LogitTransform` does not know fails, and is scored from its own
    logits instead (a second forward), so log-probs are never silently another distribution's.

    Under mixed precision accelerate runs the model's forward in autocast (bf16 / fp16 matmuls), while this check
    and the chunked head run outside it: the head's output is compared in each precision the forward may have had,
    so a rounding difference is not taken for a transform (which would cost [B, T, V] float32 logits: 2.3 GiB more
    at 16 x 256 tokens of a 152k vocabulary)."""
    if lm not in _CHECKED:
        with torch.no_grad():
            theirs = logits.float()
            tolerance = 1e-4 * max(1.0, float(theirs.abs().max()))
            _CHECKED[lm] = any(_matches(head, last_hidden, transform, theirs, tolerance, precision)
                               for precision in _precisions(last_hidden.device.type))
        if not _CHECKED[lm]:
            logger.warning("%s's logits are not its LM head's output (after the logit transforms grpo_trainer knows: "
                           "%s); its log-probs are computed from the model's own logits, which costs a second "
                           "forward and [B, T, V] logits in memory.", type(lm).__name__, transform)
    return _CHECKED[lm]


def _matches(head: nn.Module, hidden: Tensor, transform: LogitTransform, logits: Tensor, tolerance: float,
             precision: contextlib.AbstractContextManager) -> bool:
    with precision:
        ours = transform(head(hidden)).float()  # [B, V]
    return bool((ours - logits).abs().max() <= tolerance)


def _precisions(device_type: str) -> Iterator[contextlib.AbstractContextManager]:
    """As is, then under autocast to bfloat16 and to float16 (where this device has it)."""
    yield contextlib.nullcontext()
    for dtype in (torch.bfloat16, torch.float16):
        try:
            yield torch.autocast(device_type, dtype=dtype)
        except RuntimeError:  # a device without autocast for this dtype
            continue


def head_runs_inside_forward(model: nn.Module) -> bool:
    """True for a model whose LM head must run inside its own forward: FSDP2-sharded, or with a ZeRO-3 partitioned
    head (`_logprobs_from_model_logits`)."""
    return is_fsdp_module(model) or hasattr(output_head(model).weight, "ds_id")


def is_fsdp_module(model: nn.Module) -> bool:
    """True when `model` or one of its submodules is sharded with FSDP2 (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _logprobs_from_model_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_length: int,
                                temperature: float, chunk_size: int, with_entropy: bool, forward_kwargs: dict,
                                support: KeptSupport | None = None) -> LogProbs:
    """The model's own logits for the completion positions `[B, T, V]` in the model's dtype, scored chunk by chunk
    (each chunk upcast to float32 under activation checkpointing, so one float32 chunk is alive at a time).

    Three users: a model whose logits are not its head's output (`_head_reproduces_logits`), an FSDP2-sharded
    model, and a ZeRO-3 partitioned head. accelerate shards the LM head in one FSDP group with the final norm (and
    tied embeddings); projecting hidden states through that head outside the model's forward lets FSDP free the
    group's weights in the backward pass while the norm still needs them (a segfault on CPU), so there the head must
    run inside the forward. Under ZeRO-3 each call of the head outside the forward gathers its weight, a collective:
    processes whose micro-batches hold different numbers of completion tokens would project different numbers of
    chunks and wait on each other forever; inside the forward every process gathers it once per forward, as TRL
    does. The price is TRL's: `[B, T, V]` logits in the model's dtype."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_length + 1,
                use_cache=False, **forward_kwargs)
    logits = out.logits[:, :-1]  # [B, T, V]
    tokens = input_ids[:, -completion_length:]
    scores = chunked_scores(_supported_scores, logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), temperature,
                            chunk_size, support)
    return _log_probs(scores, tokens.shape, with_entropy, getattr(out, "aux_loss", None), support)


def _log_probs(scores: tuple[Tensor, ...], shape: torch.Size, with_entropy: bool, aux_loss: Tensor | None,
               support: KeptSupport | None) -> LogProbs:
    """`LogProbs` from flat per-position scores: log-probs, entropies, log kept masses, packed supports."""
    logps, entropies, masses, packed = scores
    return LogProbs(logps.view(shape), entropies.view(shape) if with_entropy else None, aux_loss,
                    masses.view(shape) if masses.numel() else None,
                    packed.view(*shape, -1) if support is not None and support.collect and packed.numel() else None)


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    known_logps: Tensor | None = None,
    known_entropy: Tensor | None = None,
    known_probs: Tensor | None = None,
    with_aux_loss: bool = False,
    model_inputs: dict | None = None,
    support: KeptSupport | None = None,
) -> LogProbs:
    """Log-probs of the last `completion_length` tokens of each row.

    Args:
        model: a causal LM (a wrapper such as DDP, DeepSpeed or PEFT is fine: it is called as is).
        input_ids: `[B, S+T]` prompt (left-padded) followed by the completion (right-padded), T = completion_length.
        attention_mask: `[B, S+T]`.
        temperature: the sampling temperature; logits are divided by it, as they were when sampling.
        chunk_size: completion positions (rows of the flattened `[B*T, H]` hidden states) projected at once, at
            most: fewer where their float32 logits would pass `LOGITS_CHUNK_BYTES` (`chunk_rows`).
        with_entropy: also return the per-token entropy of the (tempered) distribution.
        known_logps / known_entropy: `[B, T]` values already computed under these same weights (the rollout's
            sampling log-probs, on-policy). With a plain head the forward then skips the LM-head projection and
            returns them; gradients are computed exactly as without them.
        known_probs: `[B, T, V]` the tempered softmax at each position under these weights (the rollout's), used
            with `known_logps` only: the backward then takes the softmax from it instead of recomputing the logits.
        with_aux_loss: a Mixture-of-Experts model also returns its router's load-balancing loss (the model is asked
            for its router logits, `output_router_logits=True`).
        model_inputs: more keyword arguments of the forward (a vision-language model's pixel values, image grids,
            token types); a `position_ids` entry replaces the attention-mask positions (None: the model's own).
        support: the sampler's truncation (`modeling.support.KeptSupport`, its packed supports `[B*T, W]` in row
            order where the rollout returned them): every log-prob and entropy over each position's kept support,
            and the log kept mass measured. `known_*` values must have been computed the same way.
    Returns:
        `LogProbs`: logps `[B, T]` float32, entropies `[B, T]` float32 (or None), aux_loss `[]` (or None), and with a
        support the log kept masses `[B, T]` (None where the known values stood in) and the supports used.
    """
    # Positions count real tokens only, as in `generate`, so left padding does not shift them; a forward that takes
    # none derives its own (as TRL calls every model).
    extra = dict(model_inputs or {})
    if _takes(causal_lm(model), "position_ids"):
        extra.setdefault("position_ids", (attention_mask.long().cumsum(-1) - 1).clamp(min=0))
    if with_aux_loss:
        extra["output_router_logits"] = True
    if head_runs_inside_forward(model):  # see `_logprobs_from_model_logits`
        out = _logprobs_from_model_logits(
            model, input_ids, attention_mask, completion_length, temperature,
            chunk_rows(chunk_size, causal_lm(model).config.get_text_config().vocab_size), with_entropy, extra,
            support)
        return out if with_aux_loss else dataclasses.replace(out, aux_loss=None)
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, output_hidden_states=True,
                use_cache=False, **extra)
    aux_loss = getattr(out, "aux_loss", None) if with_aux_loss else None
    if with_aux_loss and aux_loss is None:
        raise ValueError(f"{type(model).__name__} returned no aux_loss for output_router_logits=True; the router "
                         "auxiliary loss needs a Mixture-of-Experts model that computes it (router_aux_loss_coef=0).")
    scorer = scoring_head(model, out, chunk_size)
    if scorer is None:
        return _logprobs_from_model_logits(model, input_ids, attention_mask, completion_length, temperature,
                                           chunk_rows(chunk_size, out.logits.shape[-1]), with_entropy, extra, support)
    # Position t predicts token t+1: the hidden states S-1 .. S+T-2 score completion tokens S .. S+T-1.
    hidden = out.hidden_states[-1][:, -completion_length - 1 : -1]  # [B, T, H]
    tokens = input_ids[:, -completion_length:]  # [B, T]
    known = None if known_logps is None else (
        known_logps.reshape(-1), None if known_entropy is None else known_entropy.reshape(-1),
        None if known_probs is None else known_probs.reshape(-1, known_probs.shape[-1]), None)
    scores = scorer.score(hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1), temperature, with_entropy, known,
                          support)  # [B*T] each
    return _log_probs(scores, tokens.shape, with_entropy, aux_loss, support)


@dataclass(frozen=True)
class ScoringHead:
    """A causal LM's LM head (and the transform its logits get), ready to score final hidden states."""

    head: nn.Module
    transform: LogitTransform
    chunk_size: int  # rows per chunk (`chunk_rows`)

    def score(self, hidden: Tensor, tokens: Tensor, temperature: float, with_entropy: bool,
              known: Known | None = None, support: KeptSupport | None = None) -> tuple[Tensor, ...]:
        """Log-probs and entropies `[N]` float32 of `tokens` `[N]` given the final hidden states `[N, H]` that
        predict them (entropies empty unless `with_entropy`), then the log kept masses `[N]` and supports `[N, W]`
        (empty without a `support`). `known`: see `_HeadLogProbs`; used by a plain head only, and only when it
        holds every value asked for (any other case recomputes)."""
        head = self.head
        if not self.transform.identity:
            head = _TransformedHead(head, self.transform)  # through the checkpointed per-chunk path below
        elif _is_plain_linear(head):
            if known is not None and with_entropy and known[1] is None:
                known = None
            precision = contextlib.nullcontext()
            if type(head) is Float32Head:  # as its forward computes: float32 hidden states and weight, no autocast
                hidden = hidden.float()
                precision = torch.autocast(hidden.device.type, enabled=False)
            with precision:
                return _HeadLogProbs.apply(hidden, head.weight, head.bias, tokens, temperature, self.chunk_size,
                                           with_entropy, known, support)
        return chunked_scores(functools.partial(_head_logprobs, head), hidden, tokens, temperature, self.chunk_size,
                              support)


def scoring_head(model: nn.Module, out: Any, chunk_size: int) -> ScoringHead | None:
    """The head that scores `model`'s final hidden states, given one forward's output `out` (called with
    `logits_to_keep=1, output_hidden_states=True`); None when the model's logits are not what that head gives
    (`_head_reproduces_logits`), so they must come from the model's own logits."""
    head, lm = output_head(model), causal_lm(model)
    transform = LogitTransform.of(getattr(lm, "config", None))
    if not _head_reproduces_logits(lm, out.logits[:, -1], out.hidden_states[-1][:, -1], head, transform):
        return None
    return ScoringHead(head, transform, chunk_rows(chunk_size, out.logits.shape[-1]))
