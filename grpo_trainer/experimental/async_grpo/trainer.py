"""`AsyncGRPOTrainer`: TRL 1.16's constructor over `GRPOTrainer` with asynchronous rollouts."""

from __future__ import annotations

from typing import Any

from grpo_trainer.experimental.async_grpo.config import AsyncGRPOConfig
from grpo_trainer.trainer import GRPOTrainer

__all__ = ["AsyncGRPOTrainer"]


class AsyncGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with asynchronous rollouts, under TRL's async trainer's constructor. `rollout_worker` and
    `weight_transfer` (TRL's plug-in protocols for its own rollout worker and NCCL weight transfer) are refused: the
    producer thread and the vLLM backend's weight push take their place."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: AsyncGRPOConfig | None = None,
                 train_dataset: Any = None, processing_class: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: Any = None, tools: list | None = None,
                 environment_factory: Any = None, rollout_worker: Any = None, weight_transfer: Any = None) -> None:
        for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise ValueError(f"AsyncGRPOTrainer({name}=...) is not supported: this trainer samples rounds on a "
                                 "producer thread and pushes weights through its vLLM backend; leave it None.")
        if args is None:
            model_id = model if isinstance(model, str) else model.config._name_or_path
            args = AsyncGRPOConfig(f"{model_id.split('/')[-1]}-AsyncGRPO")
        if not args.async_rollouts:
            raise ValueError("AsyncGRPOTrainer needs args.async_rollouts >= 1 (AsyncGRPOConfig sets it from "
                             "max_staleness); use GRPOTrainer for synchronous rollouts.")
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         peft_config=peft_config, tools=tools, environment_factory=environment_factory)
