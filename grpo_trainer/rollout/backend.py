"""The rollout-backend interface: how completions are sampled, and what each way of sampling can do.

Decisions:

1. A backend is an object with declared `Capabilities` and one method, `generate(model, prompts, config,
   capture) -> Rollout`. The trainer and `capture` read capabilities, never backend names.
2. Backends register under the names `GRPOConfig` selects them by (`BACKENDS`, `select`); a new one (vLLM, a
   user's own) is one class and one registry entry. `use_transformers_continuous_batching` selects
   transformers' continuous-batching engine whatever `generation_backend` says, as in TRL.
3. `generate` (transformers' `model.generate`) is the reference every other backend is tested against. A backend
   that cannot reproduce a model or setting falls back to it and logs why.
4. Capabilities say what a backend keeps when it serves a model itself; a fall-back keeps what the backend it
   fell back to keeps, and the `Rollout` fields it cannot fill stay None (consumers read the fields).
5. Prompts with images go to a backend whose capabilities say `images` and that takes these prompts
   (`image_support`: vLLM takes a family whose image prompts it can rebuild); any other backend's rounds with
   images run on `generate` instead (`serving`), with the reason logged once. (The continuous-batching engine is
   refused with a processor before any model loads, as in TRL.)
6. A backend that runs its own inference engine (vLLM) holds its own copy of the weights (`own_weights`): the
   trainer starts it once its models are built (`start`), pushes the policy's weights into it before each rollout
   (`sync_weights`, which skips a version it already has), and calls `generate` without gathering the model. Its
   log-probs are the engine's (`engine_logps`), not the trainer's. `check_model` refuses a model the engine cannot
   run before anything is loaded.
7. What a backend's rollout holds in the training process is its `MemoryProfile` (`memory_profile`, chosen from the
   same `BackendChoice` and registry as `select`): the memory planner reads its fields, never a backend's name.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from transformers import GenerationConfig

from grpo_trainer.rollout.capture import KEEP_NOTHING, Capture
from grpo_trainer.rollout.settings import BackendChoice
from grpo_trainer.rollout.types import PromptBatch, Rollout

__all__ = ["BACKENDS", "CONTINUOUS_BATCHING", "VLLM", "Capabilities", "MemoryProfile", "RolloutBackend", "chosen",
           "memory_profile", "register_backend", "select", "serving"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond returning tokens."""

    sampling_logps: bool = False  # each token's log-prob and entropy under the sampling weights, as the loss computes
    layer_outputs: bool = False  # can keep every decoder layer's output for `replay`
    sampling_probs: bool = False  # can keep every step's tempered softmax for `replay`
    logits_processors: bool = True  # applies every logits processor `generate` would (penalties, min_p, ...)
    stop_strings: bool = False  # honours `GenerationConfig.stop_strings`
    multi_turn: bool = True  # continues from any token-id prefix, so a tool loop can drive it
    images: bool = False  # takes image inputs with the prompts
    engine_logps: bool = False  # each sampled token's log-prob under an inference engine's own kernels
    own_weights: bool = False  # an inference engine with its own copy of the weights (decision 6)


@dataclass(frozen=True)
class MemoryProfile:
    """Where a backend's rollout keeps its memory on a device type, as the memory planner sizes it (decision 7).

    `cache`: "model" (the policy samples in this process with a KV cache), "paged" (a paged cache pool in this
    process: transformers' continuous batching), "engine" (an inference engine in this process, with its own
    weights and pool: vLLM colocated) or "remote" (nothing in this process: a server)."""

    cache: Literal["model", "paged", "engine", "remote"] = "model"
    # model types sampled by the backend's own decoder: its KV cache preallocated in the weights' dtype, one prefill
    # per group; any other model grows transformers' cache by concatenation (`model.generate`)
    decoder_architectures: frozenset[str] = frozenset()
    layer_outputs: bool = False  # `Capabilities.layer_outputs` (with the decoder only)
    sampling_probs: bool = False  # `Capabilities.sampling_probs`
    sampling_logps: bool = False  # `Capabilities.sampling_logps`: the loss forward reuses the rollout's values
    decode_mode: str = "eager"  # the decoder's static steps (`rollout.fast.static.MODES`)
    # speculative rollouts (`rollout.speculative`): the most positions one verifying forward feeds, and the cache
    # columns a row's last draft adds; 0 without drafts
    verify_positions: int = 0
    draft_columns: int = 0
    # and in host memory: the round's n-gram indexes per completion token, the history kept across rounds
    draft_index_bytes_per_token: int = 0
    draft_history_bytes: int = 0

    def describe(self) -> str:
        """A few words for the plan's header."""
        if self.cache != "model":
            return {"paged": "a paged cache pool", "engine": "an engine in the process", "remote": "a remote engine"
                    }[self.cache]
        if not self.decoder_architectures:
            return "in the process (a growing cache)"
        return f"in the process (own decoder for {', '.join(sorted(self.decoder_architectures))}, a growing cache " \
            "otherwise)"

    @property
    def in_process(self) -> bool:
        """The policy itself samples here (routing can be recorded, an asynchronous job overlaps the step)."""
        return self.cache == "model"


class RolloutBackend(ABC):
    """Samples one completion per prompt row (rows already repeated G times)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @abstractmethod
    def generate(self, model: nn.Module, prompts: PromptBatch, config: GenerationConfig,
                 capture: Capture = KEEP_NOTHING) -> Rollout:
        """Completions for `prompts` under the resolved sampling `config`; `capture` says which replay tensors the
        loss would like kept (a backend without those capabilities ignores it)."""

    @classmethod
    def from_settings(cls, choice: BackendChoice) -> RolloutBackend:
        """The backend `choice` configures (a backend with settings of its own reads them here)."""
        return cls()

    @classmethod
    def memory_profile(cls, choice: BackendChoice, device_type: str) -> MemoryProfile:
        """What this backend's rollout holds on `device_type` (decision 7): by default the policy sampling in the
        process with `model.generate`'s cache, or an engine of its own (`own_weights`)."""
        c = cls.capabilities
        return MemoryProfile(cache="engine" if c.own_weights else "model", layer_outputs=c.layer_outputs,
                             sampling_probs=c.sampling_probs, sampling_logps=c.sampling_logps)

    def check_model(self, model: str | nn.Module, trust_remote_code: bool = False) -> None:
        """Refuse a model (an id or path, before it is loaded; or a module) this backend cannot run."""
        return None

    def start(self, model: nn.Module, processing_class: Any) -> None:
        """Called once when the trainer's models are built: a backend with an engine starts it here."""
        return None

    def sampler_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The floating-point type this backend computes log-probs in when it samples `model` (the mismatch
        report's dtype rule, `algorithms.mismatch`): the model's own, or None for an engine with its own copy of the
        weights (unknown here)."""
        if self.capabilities.own_weights:
            return None
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of this backend so that a resumed run continues as the straight one (speculative
        rollouts' history of earlier completions); None: nothing."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s value from a checkpoint."""
        return None

    def sample_off_main_thread(self) -> None:
        """Called once before rounds are sampled in a producer thread (`trainer.producer`) while the training step
        runs: a backend turns off what must run beside the step."""
        return None

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Make the engine's weights those of `model` (the unwrapped policy) at `version` (the optimizer step);
        only backends with `own_weights` hold weights. A collective: every process calls it."""
        return None

    def image_support(self, prompts: PromptBatch) -> str | None:
        """Why this backend cannot sample these prompts with images (decision 5), or None when it can. Every
        process gets the same answer."""
        return None if self.capabilities.images else \
            f"generation_backend={self.name!r} does not take image inputs; rounds with images run on model.generate."


BACKENDS: dict[str, type[RolloutBackend]] = {}


def register_backend(name: str) -> Callable[[type[RolloutBackend]], type[RolloutBackend]]:
    """Class decorator: make a backend selectable as `GRPOConfig.generation_backend=name`."""

    def add(cls: type[RolloutBackend]) -> type[RolloutBackend]:
        if name in BACKENDS and BACKENDS[name] is not cls:
            raise ValueError(f"a rollout backend is already registered as {name!r}; choose another name.")
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return add


CONTINUOUS_BATCHING = "transformers_continuous_batching"  # `rollout.continuous`


VLLM = "vllm"  # `rollout.vllm.backend`


def chosen(choice: BackendChoice) -> type[RolloutBackend]:
    """The backend class `choice` names, before anything is built (a server contacted, an engine started)."""
    if choice.name not in BACKENDS:
        raise ValueError(f"unknown generation_backend {choice.name!r}; choose one of {sorted(BACKENDS)}.")
    return BACKENDS[choice.name]


def select(choice: BackendChoice) -> RolloutBackend:
    """The backend `choice` names (`config.settings.backend_choice`: `use_vllm`, then
    `use_transformers_continuous_batching`, override `generation_backend`)."""
    return chosen(choice).from_settings(choice)


def memory_profile(choice: BackendChoice, device_type: str) -> MemoryProfile:
    """The memory of the backend `choice` names, on `device_type` (decision 7): the plan's view of what `select`
    runs."""
    return chosen(choice).memory_profile(choice, device_type)


_REFERENCE = "generate"  # `rollout.generate`: takes every model's image inputs
_told_about_images: set[str] = set()


def serving(backend: RolloutBackend, prompts: PromptBatch) -> RolloutBackend:
    """The backend that samples `prompts`: `backend`, unless they hold images it cannot take (decision 5)."""
    if prompts.images is None or not prompts.images.has_images:
        return backend
    reason = backend.image_support(prompts)
    if reason is None:
        return backend
    if backend.name not in _told_about_images:
        _told_about_images.add(backend.name)
        # A backend that takes images but not these (vLLM, for some family) is worth a warning; one that never
        # takes images falls back by design.
        logger.log(logging.WARNING if backend.capabilities.images else logging.INFO, reason)
    return BACKENDS[_REFERENCE]()
