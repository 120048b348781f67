"""The reference backend: transformers' `model.generate`, one completion per prompt row."""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig

from grpo_trainer.rollout.backend import Capabilities, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.types import PromptBatch, Rollout, completion_mask

__all__ = ["GenerateBackend", "generate_rollout"]


def generate_rollout(model: nn.Module, prompts: PromptBatch, config: GenerationConfig) -> Rollout:
    """`model.generate` on the prompt rows; tokens after each row's first EOS become padding."""
    with torch.no_grad():
        output = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask, generation_config=config)
    completion_ids = output[:, prompts.ids.shape[1]:]
    eos = config.eos_token_id
    mask, truncated = completion_mask(completion_ids, eos if isinstance(eos, (list, tuple)) else [eos])
    completion_ids = completion_ids.masked_fill(mask == 0, config.pad_token_id)
    return Rollout(prompts.ids, prompts.mask, completion_ids, mask, truncated)


@register_backend("generate")
class GenerateBackend(RolloutBackend):
    """`model.generate`: every architecture, every generation setting; no sampling log-probs."""

    capabilities = Capabilities(stop_strings=True, images=True)

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        return generate_rollout(model, prompts, config)
