"""Rewards: calling reward functions and reward models with TRL's contract, and the built-in reward library."""

from grpo_trainer.rewards.checks import check_reward_setup
from grpo_trainer.rewards.scoring import RewardError, RewardFunc, RewardModel, reward_name, score_completions

__all__ = ["RewardError", "RewardFunc", "RewardModel", "check_reward_setup", "reward_name", "score_completions"]
