"""The public home of the advantage-estimator API (`fn(rewards, num_generations, scale)`), as the design documents
name it: `from grpo_trainer.advantage import GRPOAdvantage, RLOOAdvantage, register_advantage`. The estimators
live in `grpo_trainer.algorithms.advantage`; this module re-exports them under that stable path."""

from grpo_trainer.algorithms.advantage import *  # noqa: F403
from grpo_trainer.algorithms.advantage import __all__  # noqa: F401
