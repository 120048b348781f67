"""`AsyncGRPOConfig`: TRL 1.16's async fields on top of `GRPOConfig` (the package docstring maps each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_trainer.config import GRPOConfig

__all__ = ["AsyncGRPOConfig", "REFUSED_UNLESS_DEFAULT"]

# TRL field -> (its default, why another value is refused)
REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "request_timeout": (600, "generation requests have no per-request limit here; async_rollout_timeout bounds a "
                             "whole round (heartbeat_stale_after_s sets it)"),
    "weight_sync_timeout": (1800, "weight pushes wait for the server as vllm_server_timeout says"),
    "max_inflight_tasks": (-1, "each round's prompts go to the engine together; concurrency is one round"),
    "weight_sync_steps": (1, "weights are pushed after every optimizer step"),
    "token_budget": (None, "micro-batches hold per_device_train_batch_size completions (see padding_free for "
                           "padding-free forwards)"),
}


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """TRL's `AsyncGRPOConfig` fields and defaults, mapped onto `GRPOConfig`'s asynchronous rollouts."""

    learning_rate: float = _opt(1e-6, "Initial AdamW learning rate.")
    logging_steps: float = _opt(1, "Log every X optimizer steps.")
    lr_scheduler_type: str = _opt("constant", "Learning-rate schedule (TRL's async default: constant).")
    ignore_data_skip: bool = _opt(False, "False: a resumed run continues exactly, data order included (TRL's async "
                                         "trainer forces True).")
    num_generations: int = _opt(8, "Completions sampled per prompt.")
    max_completion_length: int = _opt(2048, "Maximum completion length.")
    use_vllm: bool = _opt(True, "Sample with a vLLM server (TRL's async trainer always does); False: in process.")
    vllm_mode: str = _opt("server", "'server' (TRL's async trainer) or 'colocate'.")
    vllm_server_base_url: str | None = _opt("http://localhost:8000", "Base URL of the vLLM server.")
    dtype: str = _opt("float32", "Dtype the model is loaded in (model_init_kwargs['dtype'] wins).")
    fork_threshold_tokens: int = _opt(1024, "Accepted for TRL scripts; no effect (trajectories are never "
                                            "re-tokenized here).")
    request_timeout: int = _opt(600, "TRL's per-request timeout; only its default is accepted.")
    weight_sync_timeout: int = _opt(1800, "TRL's weight-sync timeout; only its default is accepted.")
    token_budget: int | None = _opt(None, "TRL's token-budget micro-batches; only None is accepted.")
    max_inflight_tasks: int = _opt(-1, "TRL's request concurrency; only -1 (automatic) is accepted.")
    max_staleness: int = _opt(4, "Rounds sampled ahead (async_rollouts): at most this many steps stale.")
    queue_maxsize: int = _opt(1024, "Accepted: the queue holds at most async_rollouts rounds.")
    weight_sync_steps: int = _opt(1, "Optimizer steps between weight pushes; only 1 is accepted.")
    heartbeat_stale_after_s: float = _opt(300.0, "Seconds a round may take before the run stops with an error "
                                                 "(async_rollout_timeout).")

    def __post_init__(self) -> None:
        for name, (default, reason) in REFUSED_UNLESS_DEFAULT.items():
            if getattr(self, name) != default:
                raise ValueError(f"AsyncGRPOConfig({name}={getattr(self, name)!r}) is not supported: {reason}. "
                                 f"Leave {name} at {default!r}.")
        if self.max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 (got {self.max_staleness}): it is the number of rounds "
                             "sampled ahead.")
        self.async_rollouts = self.async_rollouts or self.max_staleness
        if self.async_rollout_timeout is None:
            self.async_rollout_timeout = self.heartbeat_stale_after_s
        if not isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = {"dtype": self.dtype, **(self.model_init_kwargs or {})}
        super().__post_init__()
