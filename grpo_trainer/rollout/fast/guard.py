"""When the fast decoder may run: the architectures and generation settings it reproduces, else the reason it
falls back to `model.generate`.

Decisions:

1. Settings are resolved and logits processors built by transformers itself, as `generate` does (the model's
   generation config and transformers' defaults fill unset fields), so every processor `generate` would apply is
   applied. Greedy and multinomial sampling are reproduced; beam search, assisted decoding, stop strings and time
   limits are not.
2. Models: the Llama family (`ARCHITECTURES`) with plain modules, no sharding, no active dropout, and no sliding
   window shorter than the rollout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import GenerationMode, LogitsProcessorList

from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.runtime.models import causal_lm

__all__ = ["ARCHITECTURES", "fast_path_blocker", "processors", "resolved"]

ARCHITECTURES: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}


def resolved(lm: nn.Module, config: GenerationConfig) -> GenerationConfig:
    """The settings `generate` would run with (transformers' own resolution; private API, hence the blocker's
    fallback if it changes)."""
    return lm._prepare_generation_config(config)[0]


def processors(lm: nn.Module, config: GenerationConfig, prompt_ids: Tensor, prompt_mask: Tensor):
    """The logits processors `generate` would build for these prompts (transformers' own constructor)."""
    return lm._get_logits_processor(generation_config=config, input_ids_seq_length=prompt_ids.shape[1],
                                    encoder_input_ids=prompt_ids, prefix_allowed_tokens_fn=None,
                                    logits_processor=LogitsProcessorList(), device=prompt_ids.device,
                                    model_kwargs={"attention_mask": prompt_mask})


def fast_path_blocker(model: nn.Module, config: GenerationConfig, prompt_length: int) -> str | None:
    """Why this model/config must use `model.generate` (None when the fast path reproduces it)."""
    lm = causal_lm(model)
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    try:
        settings = resolved(lm, config)
        processors(lm, settings, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    except (AttributeError, TypeError) as error:
        return f"transformers' generation internals differ from the ones this module calls ({error})"
    max_new = max_new_tokens(settings, prompt_length)
    if max_new < 1:
        return "no new tokens to generate"
    return _settings_blocker(settings) or _model_blocker(lm, prompt_length + max_new)


def _settings_blocker(config: GenerationConfig) -> str | None:
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value!r}"
    if config.max_time is not None or config.stop_strings is not None:
        return "stopping criteria max_time / stop_strings"
    if config.num_return_sequences not in (None, 1):
        return "num_return_sequences > 1"
    return None


def _model_blocker(lm: nn.Module, total_length: int) -> str | None:
    config = lm.config
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(type(p.data) is not torch.Tensor or p.numel() == 0 for p in lm.parameters()):
        return "sharded or partitioned parameters (FSDP, or ZeRO-3 without ds3_gather_for_generation)"
    if lm.training and (getattr(config, "attention_dropout", 0.0) > 0
                        or any(isinstance(m, nn.Dropout) and m.p > 0 for m in lm.modules())):
        return "dropout is active (the model is in training mode with dropout > 0)"
    decoder = lm.get_decoder()
    if not isinstance(decoder.embed_tokens, nn.Embedding) or not hasattr(decoder, "rotary_emb"):
        return "the embedding is not a plain nn.Embedding or there is no rotary-embedding module"
    if not isinstance(lm.get_output_embeddings(), nn.Linear):
        return "the LM head is not an nn.Linear"
    for layer in decoder.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < total_length:
            return f"sliding-window attention ({window} < {total_length} tokens)"
        if not all(hasattr(n, "variance_epsilon") for n in (decoder.norm, layer.input_layernorm,
                                                              layer.post_attention_layernorm)):
            return "a norm is not an RMSNorm"
    return None
