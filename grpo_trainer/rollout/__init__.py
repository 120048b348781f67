"""Rollouts: prompts in, completions out, through interchangeable backends (`backend.RolloutBackend`).

Importing this package registers the built-in backends: `generate` (transformers' `model.generate`, the
reference), `fast` and `forward` (`rollout.fast`), `transformers_continuous_batching` (`rollout.continuous`), and
`vllm` (`rollout.vllm`, selected by `use_vllm`; vllm itself is imported only when the backend is built).
"""

from grpo_trainer.rollout import continuous, generate  # noqa: F401  (they register their backends)
from grpo_trainer.rollout.backend import BACKENDS, Capabilities, RolloutBackend, register_backend, select, serving
from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast import backend as _fast  # noqa: F401  (registers "fast" and "forward")
from grpo_trainer.rollout.types import PromptBatch, Rollout
from grpo_trainer.rollout.vllm import backend as _vllm  # noqa: F401  (registers "vllm")

__all__ = ["BACKENDS", "Capabilities", "Capture", "PromptBatch", "Rollout", "RolloutBackend", "register_backend",
           "select", "serving"]
