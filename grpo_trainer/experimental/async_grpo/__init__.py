"""`trl.experimental.async_grpo`'s `AsyncGRPOConfig` and `AsyncGRPOTrainer`, as a configuration of this package's one
`GRPOTrainer` with asynchronous rollouts (`async_rollouts`, docs/ASYNC.md): a script written for TRL 1.16's async
trainer runs with the import changed to `grpo_trainer.experimental.async_grpo`.

Each of TRL's async fields is mapped onto the trainer, or refused with the reason when it asks for behaviour this
trainer does not have (`MAPPING`, and docs/ASYNC.md's table):

- `max_staleness` (4) -> `async_rollouts`: rounds sampled ahead; staleness is bounded by pacing, nothing dropped;
- `vllm_server_base_url`, `vllm_server_timeout` -> the same fields, with `use_vllm=True, vllm_mode="server"` by
  default (`use_vllm=False` samples in process);
- `heartbeat_stale_after_s` (300) -> `async_rollout_timeout`: a round taking longer stops the run with an error;
- `dtype` ("float32") -> `model_init_kwargs["dtype"]` (unless set there);
- `fork_threshold_tokens`: accepted, no effect (multi-turn trajectories are kept as token ids, never re-tokenized);
- `queue_maxsize`: accepted (the queue holds at most `async_rollouts` rounds);
- `request_timeout`, `weight_sync_timeout`, `max_inflight_tasks`, `weight_sync_steps`, `token_budget`: their
  defaults accepted, any other value refused by name (`config.REFUSED_UNLESS_DEFAULT`).

Unlike TRL's, it runs on CPU, under DDP and ZeRO-2, with in-process backends; `ignore_data_skip` defaults to False
(TRL forces True) because a resumed run here continues exactly, data order included.
"""

from grpo_trainer.experimental.async_grpo.config import AsyncGRPOConfig
from grpo_trainer.experimental.async_grpo.trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]
