"""The decoder checked against the model's own forward, once per model, before it samples anything.

`guard` inspects what it can name; this catches what it cannot: a forward hook, a kernel or module swapped
underneath the family's classes, a config field the decoder does not know. A few greedy tokens are decoded for
two of the rollout's prompts through the production loop, and the log-probs it computed at each step are compared
with one forward of the model over prompt + those tokens.

Decisions:

1. Once per model and structure: the verdict is kept per module object (weakly) with a fingerprint of what
   the decoder's arithmetic depends on: every module's class, instance-level forward and hooks, every
   parameter's and buffer's identity (the tensor object), dtype and device, and the config. Training updates
   weights in place, and ZeRO-3 gathers them into the same parameters, which changes none of these; swapping a
   module, adding a hook, casting or replacing weights does, and the check runs again. A new model object is
   always checked, even where an old one's address is reused.
2. The difference is measured on log-probs (logits up to their common shift) where the model gives a token at
   least `LOGP_FLOOR`, relative to the logits' magnitude (`TOLERANCE` x max(1, max |logit|)): what KV-cache
   decoding legitimately differs by from a full forward (summation order) scales with both: a few units of the
   dtype's epsilon, more in float32 as rounding accumulates over depth. The tolerances leave room for deeper and
   trained models, and are far below what a missing or extra computation changes. A failure logs the size of
   the difference, and the model then runs through its own forward or `generate` (`fast.backend`).
3. An exception inside the check is a mismatch with the exception as its reason: the rollout never starts on a
   decoder that fails.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from grpo_trainer.rollout.types import PromptBatch

__all__ = ["CHECK_TOKENS", "LOGP_FLOOR", "TOLERANCE", "decoder_mismatch", "fingerprint"]

logger = logging.getLogger(__name__)

CHECK_TOKENS = 4  # decode steps compared (the prefill's next-token distribution and three single-token steps)
CHECK_ROWS = 2  # distinct prompts compared (different lengths, so left padding is exercised where there is any)
LOGP_FLOOR = -20.0  # tokens the model gives less than e^-20 are not compared: their float32 exp underflows first
# Largest |log p_decoder - log p_forward| accepted, per unit of the logits' magnitude, by the model's dtype
# (decision 2; TF32 matmuls keep float16's 10 mantissa bits).
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 0.08, torch.float16: 0.01}

# (module, name) of transformers' hooks that record or mark tensors without changing them
VALUE_PRESERVING_HOOKS = {("transformers.utils.output_capturing", "output_capturing_hook"),
                          ("transformers.modeling_utils", "make_inputs_require_grads")}

_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm -> (fingerprint, reason or None)


def fingerprint(lm: nn.Module) -> tuple:
    """What the decoder's arithmetic depends on, short of the weights' values (decision 1)."""
    modules = tuple((type(m), m.__dict__.get("forward"), _hooks(m._forward_hooks), _hooks(m._forward_pre_hooks))
                    for m in lm.modules())
    tensors = tuple((id(t), t.dtype, t.device) for t in itertools.chain(lm.parameters(), lm.buffers()))
    return modules, tensors, lm.config.to_json_string(use_diff=False)


def _hooks(hooks: dict) -> tuple:
    """The handles of the hooks that may change a value. transformers' own output-recording and input-grad hooks
    do not, and come and go during training (recording hooks are installed by the first forward that asks for
    hidden states; toggling activation checkpointing around each rollout registers another input-grad hook)."""
    return tuple(handle for handle, hook in hooks.items()
                 if (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) not in VALUE_PRESERVING_HOOKS)


def decoder_mismatch(lm: nn.Module, prompts: PromptBatch,
                     decode: Callable[..., tuple[Tensor, ...]]) -> str | None:
    """Why `decode` (the fast backend's loop: `decode(lm, config, prompts, outputs, probs)`) does not reproduce
    `lm`'s forward, or None; computed once per model and structure (decision 1)."""
    key = fingerprint(lm)
    known = _VERDICTS.get(lm)
    if known is not None and known[0] == key:
        return known[1]
    try:
        difference, tolerance = _measure(lm, prompts, decode)
        reason = None if difference <= tolerance else (
            f"its log-probs differ from the model's forward by up to {difference:.3g} (tolerance {tolerance:.3g} "
            f"for {lm.dtype}): the model computes something the decoder does not")
    except Exception as error:  # noqa: BLE001 - any failure of the decoder is a reason not to use it (decision 3)
        reason = f"the decoder failed on this model ({type(error).__name__}: {error})"
    if reason is not None:
        logger.warning("The fast decoder's self-check failed for %s: %s; it will not be used for this model.",
                       type(lm).__name__, reason)
    _VERDICTS[lm] = (key, reason)
    return reason


def _measure(lm: nn.Module, prompts: PromptBatch, decode: Callable) -> tuple[float, float]:
    """The largest log-prob difference between `decode` and one full forward, and the tolerance for `lm`."""
    first, _ = prompts.distinct_rows()
    rows = first[:CHECK_ROWS]
    ids, mask = prompts.ids[rows], prompts.mask[rows]
    S = ids.shape[1]
    config = GenerationConfig(do_sample=False, max_new_tokens=CHECK_TOKENS, pad_token_id=0)
    probs = torch.empty(len(rows), CHECK_TOKENS, lm.get_output_embeddings().weight.shape[0], device=ids.device)
    with torch.inference_mode():
        tokens = decode(lm, config, PromptBatch(ids, mask), None, probs)[0]
    tokens, probs = tokens.clone(), probs[:, :tokens.shape[1]].clone()
    full_ids = torch.cat([ids, tokens[:, :-1]], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], 1)
    with torch.no_grad():
        logits = lm(input_ids=full_ids, attention_mask=full_mask, use_cache=False,
                    position_ids=(full_mask.long().cumsum(1) - 1).clamp(min=0)).logits[:, S - 1:]  # [N, T, V]
    logits = logits.float()
    expected = torch.log_softmax(logits, dim=-1)
    compared = expected > LOGP_FLOOR
    difference = (probs.log() - expected).abs()[compared].max().item()
    return difference, _tolerance(lm.dtype, logits.device) * max(1.0, logits.abs().max().item())


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return TOLERANCE[torch.float16]
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
