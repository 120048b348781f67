"""transformers' continuous-batching engine (`generate_batch`) as a rollout backend.

Selected by `use_transformers_continuous_batching` (or its deprecated name `use_transformers_paged`), which
overrides `generation_backend` as in TRL; `transformers_continuous_batching_config` holds the keyword arguments of
transformers' `ContinuousBatchingConfig`.

Decisions:

1. Called as TRL 1.16 calls it: unpadded prompt ids, the rollout's `GenerationConfig`, `max_memory_percent`
   0.5 unless set (transformers' 0.9 leaves the training step no memory), no progress bar.
2. Where TRL trusts the engine, this backend checks it: every request must come back finished and without an
   error (`generate_batch` logs failures and returns what it has), or the rollout raises. The model's training
   mode is restored afterwards (the engine leaves it in eval mode), and its weights are never cast.
3. The engine draws from its own random generator; unless the config sets `seed`, each rollout seeds it from
   torch's generator, so a seeded run samples the same completions again.
4. Capabilities: tokens only. The engine's log-probs are of the processed distribution, not the tempered
   softmax the loss scores, and it drops the logits processors it does not support (with a logged warning).

Shapes: `B` rows, `S` prompt columns, `T` completion tokens.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from grpo_trainer.modeling.unwrap import causal_lm
from grpo_trainer.rollout.backend import Capabilities, MemoryProfile, RolloutBackend, register_backend
from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.settings import BackendChoice
from grpo_trainer.rollout.types import PromptBatch, Rollout, end_at_first_eos, special_tokens

__all__ = ["ContinuousBatchingBackend", "continuous_batching_settings"]

MAX_MEMORY_PERCENT = 0.5  # TRL's training-aware default for the KV cache's share of free memory


def continuous_batching_settings(value: dict | str | None) -> dict[str, Any]:
    """`transformers_continuous_batching_config` (a dict, or its JSON from the command line) as keyword arguments
    of `ContinuousBatchingConfig`, with TRL's memory default."""
    settings = dict(json.loads(value) if isinstance(value, str) else value or {})
    settings.setdefault("max_memory_percent", MAX_MEMORY_PERCENT)
    return settings


@register_backend("transformers_continuous_batching")
class ContinuousBatchingBackend(RolloutBackend):
    """`model.generate_batch`: transformers' paged KV cache and scheduler; tokens only (decision 4)."""

    capabilities = Capabilities(logits_processors=False)

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        from transformers.generation import ContinuousBatchingConfig

        self.settings = continuous_batching_settings(settings)
        ContinuousBatchingConfig(**self.settings)  # unknown keys fail here, before any model is loaded

    @classmethod
    def memory_profile(cls, choice: BackendChoice, device_type: str) -> MemoryProfile:
        return MemoryProfile(cache="paged")

    @classmethod
    def from_settings(cls, choice: BackendChoice) -> ContinuousBatchingBackend:
        return cls(choice.continuous_batching)

    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        from transformers.generation import ContinuousBatchingConfig

        settings = dict(self.settings)
        settings.setdefault("seed", int(torch.randint(2**31 - 1, ())))  # decision 3
        lm = causal_lm(model)
        requests = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.ids, prompts.mask)]
        training = lm.training
        try:
            with torch.no_grad():
                results = lm.generate_batch(requests, generation_config=config, progress_bar=False,
                                            continuous_batching_config=ContinuousBatchingConfig(**settings))
        finally:
            lm.train(training)
        return _rollout(prompts, _completions(results, len(requests)), config)


def _completions(results: dict, count: int) -> list[list[int]]:
    """The generated tokens of each request, in request order; an error for any request that failed or is
    missing (decision 2)."""
    outputs = list(results.values())
    failed = [o.request_id for o in outputs if o.error is not None or not o.is_finished()]
    if len(outputs) != count or failed:
        raise RuntimeError(f"transformers' continuous batching returned {len(outputs)} of {count} completions"
                           + (f"; requests {failed} failed" if failed else "")
                           + ". Its log above says why; generation_backend='generate' runs without it.")
    return [o.generated_tokens for o in outputs]


def _rollout(prompts: PromptBatch, completions: list[list[int]], config: GenerationConfig) -> Rollout:
    _, pad = special_tokens(config)
    T = max(1, max(len(c) for c in completions))
    completion_ids = torch.full((len(completions), T), pad, dtype=torch.long)
    for row, tokens in enumerate(completions):
        completion_ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    completion_ids, mask, truncated = end_at_first_eos(completion_ids.to(prompts.ids.device), config)
    return Rollout(prompts.ids, prompts.mask, completion_ids, mask, truncated)
