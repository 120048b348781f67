"""`GRPOTrainer`: wires data, rollouts, rewards and the loss through `transformers.Trainer`'s hooks."""

from grpo_trainer.trainer.grpo_trainer import GRPOTrainer
from grpo_trainer.trainer.round import Round

__all__ = ["GRPOTrainer", "Round"]
