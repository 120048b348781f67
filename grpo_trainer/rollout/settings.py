"""Sampling settings for every backend: `SamplingSettings` (built once from a `GRPOConfig` by `config.settings`) and
the `transformers.GenerationConfig` a rollout uses; `PromptSettings`, how prompts are tokenised.

Decisions:

1. The named fields (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_completion_length`,
   `cache_implementation`) fill the config, then `generation_kwargs` override them, as in TRL.
2. Every EOS id of the tokenizer and of the model's generation config stops a sequence.
3. Every field this project owns is set explicitly, so a checkpoint's own sampling defaults (an Instruct model's
   `generation_config.json` with temperature 0.7, top_k 20, ...) never leak into the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig

from grpo_trainer.rollout.speculative.settings import SpeculativeSettings

__all__ = ["PromptSettings", "SamplingSettings", "eos_token_ids", "make_generation_config", "max_new_tokens"]


@dataclass(frozen=True)
class SamplingSettings:
    """The config's sampling fields (decision 1)."""

    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    generation_kwargs: dict = field(default_factory=dict)  # override the named fields, as in TRL


@dataclass(frozen=True)
class PromptSettings:
    """How prompts are tokenised (`rollout.prompts.tokenize_prompts`)."""

    max_prompt_length: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    pad_to_multiple_of: int | None = None


def eos_token_ids(tokenizer: Any, generation_config: GenerationConfig | None) -> list[int]:
    """Every token id that ends a completion."""
    ids = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, (list, tuple)) else [source])
    if not ids:
        raise ValueError("the tokenizer and the model's generation config define no eos_token_id; set "
                         "tokenizer.eos_token so completions can end.")
    return sorted(ids)


def make_generation_config(sampling: SamplingSettings, model_config: GenerationConfig | None, tokenizer: Any,
                           max_new: int | None = None, suppress_tokens: list[int] | None = None) -> GenerationConfig:
    """The rollout's `GenerationConfig`; `generation_kwargs` override the named fields. `max_new`: new tokens
    (default `max_completion_length`); `suppress_tokens`: ids never sampled (a vision-language model's image
    placeholders)."""
    settings = {
        "do_sample": True, "max_new_tokens": max_new or sampling.max_completion_length,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty,
        "eos_token_id": eos_token_ids(tokenizer, model_config), "pad_token_id": tokenizer.pad_token_id,
        "cache_implementation": sampling.cache_implementation, "disable_compile": True,
        "bos_token_id": getattr(model_config, "bos_token_id", None),
    }
    if suppress_tokens:
        settings["suppress_tokens"] = suppress_tokens
    return GenerationConfig(**{**settings, **(sampling.generation_kwargs or {})})


def max_new_tokens(config: GenerationConfig, prompt_length: int) -> int:
    """New tokens a rollout may sample: `max_new_tokens`, else what `max_length` leaves after the prompt."""
    return config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_length


@dataclass(frozen=True)
class VLLMSettings:
    """The config's vLLM fields the vLLM backend reads (TRL's names without the `vllm_` prefix; no defaults here:
    `config.settings.vllm_settings` fills every one from the config, whose defaults are the only ones)."""

    mode: str  # "colocate" | "server"
    generation_kwargs: dict | None  # passed to vLLM's SamplingParams
    structured_outputs_regex: str | None
    importance_sampling_correction: bool
    sync_check_interval: int  # 0: the weight-sync self-check off
    server_base_url: str | None
    server_host: str
    server_port: int
    server_timeout: float
    group_port: int
    enable_sleep_mode: bool
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_length: int | None
    model_impl: str
    trust_remote_code: bool
    # the engine's batch: per_device_train_batch_size x steps_per_generation completions per process
    rows_per_round: int
    longest_sequence: int | None  # max_prompt_length + max_completion_length (None: no prompt limit)
    max_completion_length: int


@dataclass(frozen=True)
class BackendChoice:
    """Which rollout backend a config asks for (`rollout.select`), with the settings the chosen one reads."""

    name: str = "fast"
    vllm: VLLMSettings | None = None  # with name "vllm"
    continuous_batching: dict | None = None  # `transformers_continuous_batching_config`
    speculative: SpeculativeSettings | None = None  # with name "fast": drafts verified by the decoder
    partial: bool = False  # with name "fast": partial rollouts end rounds in the decoder's plain loop
