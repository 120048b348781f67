"""`GRPOConfig`: every option, its default and help text, and the rules it must satisfy."""

from grpo_trainer.config.grpo_config import GRPOConfig

__all__ = ["GRPOConfig"]
