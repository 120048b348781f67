"""The small shape and settings the planner tests derive their numbers from."""

from grpo_trainer.planning import ModelShape, PlanSettings
from grpo_trainer.rollout.backend import MemoryProfile, memory_profile
from grpo_trainer.rollout.settings import BackendChoice

# A small Llama-family shape: V 1000, E 64, FFN 128, 2 layers, 4 query heads / 2 key-value heads of 16.
SHAPE = ModelShape(model_type="qwen2", vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                   head_dim=16, tied_head=True, parameters=200_000, layer_parameters=40_000, linear_parameters=60_000,
                   largest_parameter=64_000)
# 4 rows per micro-batch, one micro-step per round, prompt 6 + completion 10 = 16 tokens.
SETTINGS = PlanSettings(device="cpu", micro_batch=4, accumulation_steps=1, steps_per_generation=1, num_iterations=1,
                        num_generations=2, prompt_length=6, completion_length=10)


def rollout(name: str, device: str = "cpu") -> MemoryProfile:
    """What the backend registered as `name` holds on `device` (`rollout.backend.memory_profile`)."""
    return memory_profile(BackendChoice(name), device)
