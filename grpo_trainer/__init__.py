"""grpo_trainer: GRPO, RLOO and friends for language models, as a drop-in for `trl.GRPOTrainer`."""

from grpo_trainer.algorithms.advantage import (
    Advantage,
    GRPOAdvantage,
    RLOOAdvantage,
    get_advantage_estimator,
    register_advantage,
)
from grpo_trainer.config import GRPOConfig
from grpo_trainer.trainer import GRPOTrainer

__version__ = "0.1.0"
__all__ = ["Advantage", "GRPOAdvantage", "GRPOConfig", "GRPOTrainer", "RLOOAdvantage", "get_advantage_estimator",
           "register_advantage"]
