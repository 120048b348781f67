"""Between the rollout types and vLLM: sampling parameters, requests, and the `Rollout` built from vLLM's outputs.

Decisions:

1. Sampling parameters come from the rollout's `GenerationConfig` (temperature, top-p, top-k, min-p, repetition
   penalty, max_new_tokens, every EOS id as a stop token), then `generation_kwargs` override them under vLLM's own
   `SamplingParams` names, as in TRL; greedy decoding (`do_sample=False`) is temperature 0. Every request asks for
   the sampled token's log-prob (`logprobs=0`).
2. The rows of a prompt batch repeat each prompt G times in a row: each run of identical rows is one request with
   `n` = its length, so the engine prefills the prompt once, and its completions come back in row order.
3. vLLM's log-probs are the engine's (`SamplerRecord.logps`, kind `engine`), never the trainer's: a token vLLM
   could not score is NaN. Completions end at their first EOS (vLLM includes the EOS it stopped on); the rest is
   padding.
4. A prompt with images goes to vLLM as the chat template wrote it, each image as its placeholder
   (`multimodal.unexpanded_ids`), with the images themselves: vLLM expands the placeholders with its own processor.
   The prompt it ends up with must be the trainer's, token for token (`check_engine_prompts`); otherwise the loss
   would score other contexts than the ones sampled from, and the round stops with both token lists.
5. Tokens the rollout must never sample (`GenerationConfig.suppress_tokens`: a vision-language model's image
   placeholders, whose features would not exist) get vLLM's strongest negative `logit_bias`. TRL suppresses them
   for `model.generate` only; with vLLM a sampled image token would break the loss forward.

Shapes: `B` rows, `T` completion tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig

from grpo_trainer.rollout.settings import max_new_tokens
from grpo_trainer.rollout.types import PromptBatch, Rollout, SamplerRecord, end_at_first_eos, special_tokens

__all__ = ["Completion", "Request", "check_engine_prompts", "check_generation_kwargs", "prompt_runs", "row_ids",
           "run_starts", "sampling_settings", "to_rollout"]

Completion = tuple[list[int], list[float | None]]  # token ids, the engine's log-prob of each


class Request(NamedTuple):
    """One prompt for the engine: its token ids as the engine takes them, how many completions to sample, and its
    images (None without) for an engine that processes them (decision 4)."""

    ids: list[int]
    n: int
    images: list | None = None


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
    suppressed = {int(token): -100.0 for token in config.suppress_tokens or []}  # vLLM's strongest bias
    user = dict(generation_kwargs or {})
    if suppressed:  # decision 5; a user's own logit_bias keeps its other entries
        user["logit_bias"] = {**{int(k): v for k, v in (user.get("logit_bias") or {}).items()}, **suppressed}
    settings.update(user)
    if regex is not None:
        settings["structured_outputs"] = {"regex": regex}
    return settings


def run_starts(prompts: PromptBatch, greedy: bool = False) -> list[tuple[int, int]]:
    """(first row, rows) of each run of identical rows, in row order (decision 2); one per row when `greedy` (vLLM
    samples a greedy request once)."""
    rows = prompts.ids.shape[0]
    if greedy:
        return [(row, 1) for row in range(rows)]
    starts, _ = prompts.distinct_rows()
    ends = torch.cat([starts[1:], starts.new_tensor([rows])])
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def row_ids(prompts: PromptBatch, row: int) -> list[int]:
    """A row's prompt ids without padding."""
    return prompts.ids[row][prompts.mask[row].bool()].tolist()


def prompt_runs(prompts: PromptBatch, greedy: bool = False, engine_ids: dict[int, list[int]] | None = None
                ) -> list[Request]:
    """One request per run of identical rows (decision 2). With images, each request carries its row's images and
    the row's ids with their image placeholders unexpanded, `engine_ids[row]` (decision 4)."""
    images = prompts.image_lists if prompts.image_lists is not None and any(prompts.image_lists) else None
    if images is None:
        return [Request(row_ids(prompts, row), n) for row, n in run_starts(prompts, greedy)]
    return [Request(engine_ids[row], n, images[row] or None) if images[row] else Request(row_ids(prompts, row), n)
            for row, n in run_starts(prompts, greedy)]


def check_engine_prompts(prompts: PromptBatch, greedy: bool, seen: Sequence[list[int] | None], family: str) -> None:
    """RuntimeError unless every prompt the engine expanded is the trainer's row, token for token (decision 4)."""
    for (row, _), engine in zip(run_starts(prompts, greedy), seen):
        ours = row_ids(prompts, row)
        if engine is not None and list(engine) != ours:
            raise RuntimeError(
                f"vLLM expanded the image placeholders of a {family} prompt into other tokens than the processor did, "
                f"so the loss would score another context than the one vLLM sampled from.\n  processor: {ours}\n  "
                f"vLLM:      {list(engine)}\nTrain this model with use_vllm=False, or with a processor whose image "
                "token counts match vLLM's.")


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
    return Rollout(prompts.ids, prompts.mask, ids, mask, truncated, SamplerRecord("engine", logps=engine_logps))
