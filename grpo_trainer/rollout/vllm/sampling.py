"""Between the rollout types and vLLM: sampling parameters, requests, and the `Rollout` built from vLLM's outputs.

Decisions:

1. Sampling parameters come from the rollout's `GenerationConfig` (temperature, top-p, top-k, min-p, repetition
   penalty, max_new_tokens, every EOS id as a stop token), then `generation_kwargs` override them under vLLM's own
   `SamplingParams` names, as in TRL; greedy decoding (`do_sample=False`) is temperature 0. Every request asks for
   the sampled token's log-prob (`logprobs=0`).
2. The rows of a prompt batch repeat each prompt G times in a row: each run of identical rows is one request with
   `n` = its length, so the engine prefills the prompt once, and its completions come back in row order.
3. vLLM's log-probs are the engine's (`Rollout.engine_logps`), never the trainer's: a token vLLM could not score is
   NaN. Completions end at their first EOS (vLLM includes the EOS it stopped on); the rest is padding.

Shapes: `B` rows, `T` completion tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.rollout.types import PromptBatch, Rollout, end_at_first_eos, special_tokens

__all__ = ["Completion", "check_generation_kwargs", "prompt_runs", "sampling_settings", "to_rollout"]

Completion = tuple[list[int], list[float | None]]  # token ids, the engine's log-prob of each


def check_generation_kwargs(generation_kwargs: dict | None) -> None:
    """ValueError for a `generation_kwargs` key that vLLM's `SamplingParams` does not have (with use_vllm, TRL
    passes them to vLLM unchanged)."""
    from vllm import SamplingParams

    known = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}
    unknown = sorted(set(generation_kwargs or {}) - known)
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} are not vLLM sampling parameters: with use_vllm=True they go "
                         f"to vllm.SamplingParams, whose fields are {sorted(known)}.")


def sampling_settings(config: GenerationConfig, prompt_length: int, generation_kwargs: dict | None,
                      regex: str | None) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` (JSON-compatible: a regex is `{"regex": ...}` under
    `structured_outputs`) for the rollout's `config` (decision 1)."""
    settings: dict[str, Any] = {
        "temperature": config.temperature if config.do_sample else 0.0,
        "top_p": 1.0 if config.top_p is None else config.top_p,
        "top_k": config.top_k or 0,
        "min_p": config.min_p or 0.0,
        "repetition_penalty": config.repetition_penalty or 1.0,
        "max_tokens": max_new_tokens(config, prompt_length),
        "stop_token_ids": special_tokens(config)[0],
        "logprobs": 0,
    }
    settings.update(generation_kwargs or {})
    if regex is not None:
        settings["structured_outputs"] = {"regex": regex}
    return settings


def prompt_runs(prompts: PromptBatch, greedy: bool = False) -> list[tuple[list[int], int]]:
    """(prompt token ids without padding, rows) for each run of identical rows, in row order (decision 2); one per
    row when `greedy` (vLLM samples a greedy request once)."""
    if greedy:
        return [(ids[mask.bool()].tolist(), 1) for ids, mask in zip(prompts.ids, prompts.mask)]
    starts, _ = prompts.distinct_rows()
    ends = torch.cat([starts[1:], starts.new_tensor([prompts.ids.shape[0]])])
    return [(prompts.ids[s][prompts.mask[s].bool()].tolist(), int(e - s)) for s, e in zip(starts, ends)]


def to_rollout(prompts: PromptBatch, completions: Sequence[Completion], config: GenerationConfig) -> Rollout:
    """The `Rollout` of one completion per prompt row (decision 3)."""
    _, pad = special_tokens(config)
    T = max(1, max(len(ids) for ids, _ in completions))
    ids = torch.full((len(completions), T), pad, dtype=torch.long)
    logps = torch.zeros(len(completions), T)
    for row, (tokens, values) in enumerate(completions):
        ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logps[row, :len(values)] = torch.tensor([math.nan if v is None else v for v in values])
    device = prompts.ids.device
    ids, mask, truncated = end_at_first_eos(ids.to(device), config)
    engine_logps = logps.to(device).masked_fill(mask == 0, 0.0)
    return Rollout(prompts.ids, prompts.mask, ids, mask, truncated, engine_logps=engine_logps)
