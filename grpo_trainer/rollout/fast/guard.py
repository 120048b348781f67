"""When the fast decoder may run: the generation settings it reproduces and the modules it re-implements, else the
reason it falls back.

Decisions:

1. Settings are resolved and logits processors built by transformers itself, as `generate` does (the model's
   generation config and transformers' defaults fill unset fields), so every processor `generate` would apply is
   applied. Greedy and multinomial sampling are reproduced; beam search, assisted decoding, stop strings and time
   limits are not (`settings_blocker`, which also refuses a patched `generate`: then `generate` is what the user
   wants run).
2. The decoder re-implements modules, so the guard inspects the modules, not only the config (`decoder_blocker`):
   each module it replaces must run its family's own `forward` (no subclass overriding it, no instance-level
   patch), and have the attributes the decoder reads; the rotary module must take `(x, position_ids)` only and use
   a RoPE type reproduced exactly (`ROPE_TYPES`; dynamic and long RoPE only where they reduce to their static
   form). Anything else is a reason to fall back, found before a rollout starts, never a crash inside one.
3. What inspection cannot see (a hook, a changed kernel) is caught by `selfcheck`, which compares the decoder's
   logits with the model's own forward once per model.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from numbers import Real

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import GenerationMode, LogitsProcessorList

from grpo_trainer.modeling import swaps
from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.generate import generate_override
from grpo_trainer.rollout.settings import max_new_tokens

__all__ = ["ARCHITECTURES", "ROPE_TYPES", "decoder_blocker", "processors", "resolved",
           "settings_blocker"]

# model_type -> (the class-name prefix of its modeling module, whether attention normalises q and k)
ARCHITECTURES: dict[str, tuple[str, bool]] = {"llama": ("Llama", False), "mistral": ("Mistral", False),
                                               "qwen2": ("Qwen2", False), "qwen3": ("Qwen3", True)}
# RoPE types whose frequencies are fixed when the module is built: the decoder's one table per rollout is exact.
# "dynamic" and "longrope" recompute them from the longest position of each call; they equal their static form
# only while a rollout stays within the original context (`_rope_blocker`).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def settings_blocker(model: nn.Module, config: GenerationConfig, prompt_length: int) -> str | None:
    """Why these settings, or this model's plumbing, need `model.generate` itself, whatever the architecture."""
    reason = generate_override(model)
    if reason is not None:
        return reason
    lm = causal_lm(model)
    try:
        settings = resolved(lm, config)
        processors(lm, settings, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    except (AttributeError, TypeError) as error:
        return f"transformers' generation internals differ from the ones this module calls ({error})"
    if max_new_tokens(settings, prompt_length) < 1:
        return "no new tokens to generate"
    mode = settings.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value!r}"
    if settings.max_time is not None or settings.stop_strings is not None:
        return "stopping criteria max_time / stop_strings"
    if settings.num_return_sequences not in (None, 1):
        return "num_return_sequences > 1"
    if any(type(p.data) is not torch.Tensor or p.numel() == 0 for p in lm.parameters()):
        return "sharded or partitioned parameters (FSDP, or ZeRO-3 without ds3_gather_for_generation)"
    if lm.training and (getattr(lm.config, "attention_dropout", 0.0) > 0
                        or any(isinstance(m, nn.Dropout) and m.p > 0 for m in lm.modules())):
        return "dropout is active (the model is in training mode with dropout > 0)"
    return None


def decoder_blocker(lm: nn.Module, total_length: int) -> str | None:
    """Why the hand-written decoder does not reproduce this causal LM over `total_length` cache columns."""
    config = lm.config
    if config.model_type not in ARCHITECTURES:
        return f"model_type {config.model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    prefix, qk_norm = ARCHITECTURES[config.model_type]
    family = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    try:
        decoder = lm.get_decoder()
        return (_structure_blocker(lm, decoder, family, prefix) or _rope_blocker(decoder.rotary_emb, total_length)
                or _window_blocker(config, decoder, total_length)
                or _layers_blocker(config, decoder, family, prefix, qk_norm))
    except AttributeError as error:  # a module or config field the decoder reads is not there
        return f"the model lacks what the decoder reads ({error})"


def _runs_own_forward(module: nn.Module, cls: type | None) -> str | None:
    """Why `module` does not compute `cls.forward` (None when it does)."""
    if cls is None or not isinstance(module, nn.Module):
        return f"{type(module).__name__} is not an nn.Module of the expected class"
    if swaps.patched(module):
        return f"{type(module).__name__}.forward is patched on the instance"
    if type(module).forward is not cls.forward:
        return f"{type(module).__name__} runs its own forward, not {cls.__name__}.forward"
    return None


def _structure_blocker(lm: nn.Module, decoder: nn.Module, family, prefix: str) -> str | None:
    if not isinstance(getattr(decoder, "embed_tokens", None), nn.Embedding):
        return "the embedding is not a plain nn.Embedding"
    if type(lm.get_output_embeddings()) is not nn.Linear:
        return "the LM head is not an nn.Linear"
    for module, name in ((lm, "ForCausalLM"), (decoder, "Model"), (getattr(decoder, "rotary_emb", None),
                                                                   "RotaryEmbedding")):
        reason = _runs_own_forward(module, getattr(family, prefix + name, None))
        if reason is not None:
            return reason
    return None


def _rope_blocker(rotary: nn.Module, total_length: int) -> str | None:
    """The rotary module is called as `rotary(x, position_ids)` once per rollout for every position: its
    frequencies must not depend on the call (decision 2)."""
    parameters = list(inspect.signature(type(rotary).forward).parameters)
    if parameters != ["self", "x", "position_ids"]:
        return f"the rotary embedding's forward takes ({', '.join(parameters[1:])}), not (x, position_ids)"
    rope_type = getattr(rotary, "rope_type", None)
    if rope_type == "dynamic" and total_length < getattr(rotary, "original_max_seq_len", 0):
        return None  # dynamic NTK scaling starts beyond the original context
    if rope_type == "longrope":
        original = rotary.config.rope_parameters.get("original_max_position_embeddings", 0)
        if total_length <= original:
            return None  # long factors start beyond the original context
    if rope_type not in ROPE_TYPES:
        return f"RoPE type {rope_type!r} over {total_length} columns (reproduced: {', '.join(ROPE_TYPES)})"
    return None


def _window_blocker(config, decoder: nn.Module, total_length: int) -> str | None:
    """Sliding windows are read where the families read them: the config (Mistral) or the attention (Qwen2)."""
    windows = [getattr(config, "sliding_window", None)]
    windows += [getattr(layer.self_attn, "sliding_window", None) for layer in decoder.layers]
    shortest = min((w for w in windows if w is not None), default=None)
    if shortest is not None and shortest < total_length:
        return f"sliding-window attention ({shortest} < {total_length} tokens)"
    return None


def _layers_blocker(config, decoder: nn.Module, family, prefix: str, qk_norm: bool) -> str | None:
    H, K = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    if 2 * decoder.rotary_emb.inv_freq.numel() != D:
        return f"the rotary embedding covers {2 * decoder.rotary_emb.inv_freq.numel()} of {D} head dimensions"
    norm = getattr(family, prefix + "RMSNorm", None)
    reason = _runs_own_forward(decoder.norm, norm) or _missing(decoder.norm, "weight", "variance_epsilon")
    for layer in decoder.layers:
        if reason is not None:
            return reason
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)] if qk_norm else []
        classes = [(layer, "DecoderLayer"), (attn, "Attention"), (mlp, "MLP")]
        reason = _first(_runs_own_forward(m, getattr(family, prefix + name, None)) for m, name in classes) \
            or _first(_runs_own_forward(n, norm) or _missing(n, "weight", "variance_epsilon") for n in norms) \
            or _attention_blocker(attn, H, K, D) or _missing(mlp, "gate_proj", "up_proj", "down_proj", "act_fn") \
            or (None if callable(mlp.act_fn) else "the MLP's act_fn is not callable")
    return reason


def _attention_blocker(attn: nn.Module, H: int, K: int, D: int) -> str | None:
    """The attributes the decoder reads from an attention module, and the widths it assumes."""
    reason = _missing(attn, "q_proj", "k_proj", "v_proj", "o_proj", "scaling")
    if reason is not None:
        return reason
    if not isinstance(attn.scaling, Real):
        return f"the attention's scaling is a {type(attn.scaling).__name__}, not a number"
    widths = [getattr(getattr(attn, p), "out_features", None) for p in ("q_proj", "k_proj", "v_proj")]
    if widths != [H * D, K * D, K * D]:
        return f"q/k/v projections of widths {widths}, not {[H * D, K * D, K * D]} ({H}/{K} heads of {D})"
    return None


def _first(reasons: Iterable[str | None]) -> str | None:
    """The first reason given (the rest are not computed)."""
    return next((reason for reason in reasons if reason is not None), None)


def _missing(module: nn.Module, *names: str) -> str | None:
    absent = [name for name in names if not hasattr(module, name)]
    return f"{type(module).__name__} has no attribute {', '.join(absent)}" if absent else None
