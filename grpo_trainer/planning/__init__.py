"""The memory planner: peak memory per process, itemised, from a run's settings and its model's config, before any
weight is loaded (docs/MEMORY.md).

    shape = model_shape(AutoConfig.from_pretrained(path), lora_config)     # meta device: no weights read
    plan = plan_memory(settings, shape)                                     # pure arithmetic
    print(format_plan(plan, device_memory("cuda")))

`PlanSettings` is built from a `GRPOConfig` outside this package (`trainer.memory.plan_settings`): the planner takes
only the typed settings it needs.
"""

from grpo_trainer.planning.device import DEVICE_MEMORY_ENV, device_memory, parse_size
from grpo_trainer.planning.estimate import INSTANTS, Item, MemoryPlan, activation_bytes_per_token, plan_memory
from grpo_trainer.planning.fit import SPLIT_EXACT, Fit, fitting, split_is_exact
from grpo_trainer.planning.longest import MAX_COMPLETION_SEARCH, Longest, longer_settings, longest_completion
from grpo_trainer.planning.optimizers import OPTIMIZERS, optimizer_memory
from grpo_trainer.planning.report import fit_advice, format_longest, format_plan, over_budget_message, verdict
from grpo_trainer.planning.settings import DTYPE_BYTES, DeviceMemory, ModelShape, PlanSettings
from grpo_trainer.planning.shape import model_shape, shape_of

__all__ = ["DEVICE_MEMORY_ENV", "DTYPE_BYTES", "INSTANTS", "MAX_COMPLETION_SEARCH", "OPTIMIZERS", "SPLIT_EXACT",
           "DeviceMemory", "Fit", "Item", "Longest", "MemoryPlan", "ModelShape", "PlanSettings",
           "activation_bytes_per_token", "device_memory", "fit_advice", "fitting", "format_longest", "format_plan",
           "longer_settings", "longest_completion", "model_shape", "optimizer_memory", "over_budget_message",
           "parse_size", "plan_memory", "shape_of", "split_is_exact", "verdict"]
