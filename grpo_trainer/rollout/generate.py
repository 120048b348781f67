"""The reference backend: transformers' `model.generate`, one completion per prompt row.

`generate_override` tells other backends when `generate` is not transformers' own: a patch on `GenerationMixin`
or on the model (tests and researchers force completions that way), or a model class with a `generate` of its
own. Those backends then call `generate`, since that is what the user asked to run.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation import GenerationMixin

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.backend import Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.types import PromptBatch, Rollout, completion_mask

__all__ = ["GenerateBackend", "generate_override", "generate_rollout"]

_STOCK_GENERATE = GenerationMixin.generate  # transformers' own, as imported


def generate_rollout(model: nn.Module, prompts: PromptBatch, config: GenerationConfig) -> Rollout:
    """`model.generate` on the prompt rows (with their image inputs, if any); tokens after each row's first EOS
    become padding."""
    images = {} if prompts.images is None else prompts.images.model_inputs()
    with torch.no_grad():
        output = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, generation_config=config,
                                **images)
    completion_ids = output[:, prompts.ids.shape[1]:]
    eos = config.eos_token_id
    mask, truncated = completion_mask(completion_ids, eos if isinstance(eos, (list, tuple)) else [eos])
    completion_ids = completion_ids.masked_fill(mask == 0, config.pad_token_id)
    return Rollout(prompts.ids, prompts.mask, completion_ids, mask, truncated)


def generate_override(model: nn.Module) -> str | None:
    """Why `model.generate` may not run transformers' `GenerationMixin.generate` (None when it does): a
    replacement on the model or any wrapper around it (an instance attribute), on `GenerationMixin` itself, or in
    the model's class."""
    wrapper = model
    while True:
        if "generate" in vars(wrapper):
            return f"generate is replaced on the {type(wrapper).__name__} instance"
        if not hasattr(wrapper, "module"):
            break
        wrapper = wrapper.module
    lm = causal_lm(model)
    for inner in (getattr(wrapper, "base_model", None), lm):  # PEFT: the tuner model, then the causal LM
        if inner is not None and "generate" in vars(inner):
            return f"generate is replaced on the {type(inner).__name__} instance"
    if GenerationMixin.generate is not _STOCK_GENERATE:
        return "transformers.GenerationMixin.generate is patched"
    if type(lm).generate is not _STOCK_GENERATE:
        return f"{type(lm).__name__} has a generate of its own"
    return None


@register_backend("generate")
class GenerateBackend(RolloutBackend):
    """`model.generate`: every architecture (vision-language models with their images included), every generation
    setting; no sampling log-probs."""

    capabilities = Capabilities(stop_strings=True, images=True)

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        return generate_rollout(model, prompts, config)
