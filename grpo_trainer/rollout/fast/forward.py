"""The model's own forward as a rollout backend: each distinct prompt prefilled once, its cache shared by its rows.

For the architectures the hand-written decoder does not serve (GPT-2, Gemma-2, Phi-3, Mixtral, sliding windows,
dynamic RoPE past the original context, ...). The arithmetic is the model's, called as `generate` calls it: the
cache `generate` builds (`DynamicCache` from the config, sliding layers included), inputs from the model's own
`prepare_inputs_for_generation`, positions and masks from the attention mask, `logits_to_keep=1`. So greedy tokens
equal `generate`'s. What is saved is the prefill of each prompt's G - 1 copies; what is gained is the token loop
the decoder uses (`loop.run`: every logits processor, sampling log-probs for the loss, a stop on NaN logits).

Decisions:

1. A registered backend of its own ("forward"), and the fast backend's tier for models its decoder refuses:
   selectable and tested on its own, and its capabilities differ from the decoder's (no layer outputs: the
   model's forward does not hand out every layer's output at every step).
2. Sampling log-probs (and the softmax for `replay`) are kept only where the model's logits are its LM head's
   output, which is how the loss computes them (`modeling.logprobs`); a model that scales or soft-caps its
   logits (Gemma-2, Cohere) gets None, and the trainer computes its old log-probs itself. Checked at each
   prefill, by a hook on the head for that one call.
3. Not served (the caller falls back to `generate`): encoder-decoder and multimodal models, and models whose cache
   is not transformers' dynamic cache of attention layers (recurrent or linear-attention states).
4. The tier drives transformers' generation helpers, some of them private (`GENERATION_HELPERS`). Each must exist
   and take, by name, the parameters passed to it: a parameter that a `**kwargs` would swallow silently is not
   enough. Otherwise the rollout falls back to `generate` before it starts, with the helper named in the log,
   instead of crashing (or sampling wrongly) mid-rollout after a transformers upgrade.

Shapes: `B` rows, `P` distinct prompts, `S` prompt columns, `T` new tokens, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging

import torch
from torch import Tensor, nn
from transformers import DynamicCache, GenerationConfig

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout import capture as capture_
from grpo_trainer.rollout.backend import Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.fast import loop
from grpo_trainer.rollout.fast.guard import resolved, settings_blocker
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.rollout.types import PromptBatch, Rollout, special_tokens
from grpo_trainer.runtime import compat

__all__ = ["GENERATION_HELPERS", "ForwardBackend", "forward_blocker", "forward_rollout"]

# transformers' generation helpers this tier calls -> the parameters it passes them by name (decision 4)
GENERATION_HELPERS: dict[str, tuple[str, ...]] = {
    "prepare_inputs_for_generation": ("next_sequence_length", "attention_mask", "is_first_iteration"),
    "_update_model_kwargs_for_generation": ("outputs", "model_kwargs"),
    "_supports_default_dynamic_cache": (),
}

logger = logging.getLogger(__name__)


@register_backend("forward")
class ForwardBackend(RolloutBackend):
    """The model's own forward over a shared-prefix cache; `model.generate` for what it does not serve."""

    capabilities = Capabilities(sampling_logps=True, sampling_probs=True)  # where decision 2 holds

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        lm = causal_lm(model)
        reason = settings_blocker(model, config, prompts.ids.shape[1]) or forward_blocker(lm)
        if reason is not None:
            logger.info("generation_backend='forward' falls back to model.generate: %s.", reason)
            return generate_rollout(model, prompts, config)
        return forward_rollout(lm, prompts, resolved(lm, config), capture)


def forward_blocker(lm: nn.Module) -> str | None:
    """Why this causal LM's forward cannot be driven the way this module drives it (decision 3)."""
    config = lm.config
    if config.is_encoder_decoder:
        return "an encoder-decoder model"
    if config.get_text_config(decoder=True) is not config:
        return "a multimodal model"
    changed = _changed_helper(lm)
    if changed is not None:
        return changed
    if not lm._supports_default_dynamic_cache():
        return f"{type(lm).__name__} keeps a cache of its own"
    if compat.has_linear_attention(config):
        return "recurrent or linear-attention layers"
    return None


def _changed_helper(lm: nn.Module) -> str | None:
    """Which generation helper is missing or no longer takes what this tier passes (decision 4), or None. The
    parameters are read off transformers' own `GenerationMixin` (a model's override may take `**kwargs` and hand
    them to it)."""
    from transformers.generation.utils import GenerationMixin

    for name, parameters in GENERATION_HELPERS.items():
        stock = getattr(GenerationMixin, name, None)
        if not callable(getattr(lm, name, None)) or stock is None:
            return f"transformers {transformers_version()} has no {name}, which the forward tier calls"
        try:
            accepted = inspect.signature(stock).parameters
        except (TypeError, ValueError):
            return f"transformers {transformers_version()}'s {name} has no readable signature"
        missing = [p for p in parameters if p not in accepted]
        if missing:
            return f"transformers {transformers_version()}'s {name} no longer takes {missing}"
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def forward_rollout(lm: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                    capture: Capture = KEEP_NOTHING) -> Rollout:
    """Completions for `prompts` under resolved settings `config`, through `lm`'s own forward."""
    B, S = prompts.ids.shape
    max_new = max_new_tokens(config, S)
    vocab = lm.get_output_embeddings().weight.shape[0]
    _, probs = capture_.replay_buffers(
        dataclasses.replace(capture, layer_outputs=False), rows=B, prompt_length=S, max_new_tokens=max_new,
        layers=0, hidden_size=0, vocab_size=vocab, dtype=lm.dtype, device=prompts.ids.device)
    masks = capture_.support_buffer(capture, rows=B, max_new_tokens=max_new, vocab_size=vocab,
                                    device=prompts.ids.device)
    with torch.no_grad():
        decoded, plain_logits = _decode(lm, config, prompts, max_new, probs, masks, capture.kept_support)
    rollout = loop.to_rollout(prompts, config, decoded, probs, masks)
    if not plain_logits:  # decision 2: the sampler's own values stay (the processed log-probs, the supports)
        rollout = dataclasses.replace(rollout, sampler=dataclasses.replace(
            rollout.sampler, logps=None, entropy=None, exact=False,
            replay=dataclasses.replace(rollout.sampler.replay, probs=None)))
    return rollout


def _decode(lm: nn.Module, config: GenerationConfig, prompts: PromptBatch, max_new: int, probs: Tensor | None,
            masks: Tensor | None = None, renormalise: bool = False) -> tuple[loop.Decoded, bool]:
    """`loop.run` over the model's forward; also whether its logits are its head's output (decision 2)."""
    B, S = prompts.ids.shape
    first, group = prompts.distinct_rows()
    mask = prompts.mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate's position ids
    accepted = inspect.signature(lm.forward).parameters
    cache = compat.cache_argument(lm)
    kwargs = {cache: DynamicCache(config=lm.config), "use_cache": True}
    # generate drops an all-ones mask (no padding anywhere) before its first forward; so do we.
    if "attention_mask" in accepted and not bool((mask == 1).all()):
        kwargs["attention_mask"] = mask[first]
    if "position_ids" in accepted:
        kwargs["position_ids"] = positions[first]
    if "logits_to_keep" in accepted:
        kwargs["logits_to_keep"] = 1

    head_output = []
    hook = lm.get_output_embeddings().register_forward_hook(lambda m, i, out: head_output.append(out))
    try:
        inputs = lm.prepare_inputs_for_generation(prompts.ids[first], is_first_iteration=True, **kwargs)
        out = lm(**inputs, return_dict=True)
    finally:
        hook.remove()
    plain_logits = len(head_output) == 1 and torch.equal(head_output[0][:, -1].float(), out.logits[:, -1].float())
    kwargs = lm._update_model_kwargs_for_generation(out, kwargs)
    kwargs[cache].batch_select_indices(group)  # each row takes its prompt's keys and values
    for name in ("attention_mask", "position_ids"):
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][group]
    scores = out.logits[:, -1].float()[group]  # [B, V]
    del out
    sequences = torch.cat([prompts.ids, prompts.ids.new_full((B, max_new), special_tokens(config)[1])], 1)

    def next_scores(tokens: Tensor, t: int) -> Tensor:
        nonlocal kwargs
        inputs = lm.prepare_inputs_for_generation(sequences[:, :S + t + 1], next_sequence_length=1, **kwargs)
        out = lm(**inputs, return_dict=True)
        kwargs = lm._update_model_kwargs_for_generation(out, kwargs)
        return out.logits[:, -1].float()

    # generate's decode-time switches (MoE expert kernels on accelerators), after the prefill as there
    with getattr(lm, "_optimize_model_for_decode", contextlib.nullcontext)():
        return loop.run(lm, config, prompts, scores, next_scores, sequences, max_new, probs, masks,
                        renormalise), plain_logits
