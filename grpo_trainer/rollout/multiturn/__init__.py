"""Multi-turn rollouts: tools, environments and user-owned rollouts (`GRPOTrainer(tools=, environment_factory=,
rollout_func=)`, TRL's arguments and contracts; docs/TOOLS.md).

| module | owns |
| --- | --- |
| `episode` | one round: environments reset, prompts with their tools, first turn, tool loop -> `Episode` |
| `loop` | the tool loop over any rollout backend; trajectories -> `Rollout` with `env_mask` |
| `tool_calls` | reading tool calls out of a completion in the chat template's format |
| `chat` | the chat template's side: does it render tools, which tokens follow a tool call |
| `tools` | checking tools, running them (sync and async) |
| `environments` | `environment_factory`: tools per environment, instance pools, environment-owned rewards |
| `rollout_func` | the `rollout_func` contract and its checks |
"""

from grpo_trainer.rollout.multiturn.environments import Environments, placeholder_dataset
from grpo_trainer.rollout.multiturn.episode import Episode, MultiTurn, TurnSettings
from grpo_trainer.rollout.multiturn.rollout_func import RolloutFuncOutput, call_rollout_func

__all__ = ["Environments", "Episode", "MultiTurn", "RolloutFuncOutput", "TurnSettings", "call_rollout_func",
           "placeholder_dataset"]
