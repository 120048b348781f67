"""One generation round of multi-turn rollouts: what the trainer calls when `tools`, `environment_factory` or
`rollout_func` is given (and only then: a single-turn run never reaches this module).

A round (`MultiTurn.run`): each row gets its environment (reset with the row), its prompt is rendered with the tools
it is offered, the first turn comes from the rollout backend or the user's `rollout_func`, then the tool loop
continues every rollout whose turn called tools (`loop`). The result, an `Episode`, is a `Rollout` like a
single-turn one (plus `env_mask` when tools wrote tokens), the completions as chat messages for the reward
functions, and the keyword arguments the reward functions get besides (`environments`, a rollout_func's fields).

Everything that can be checked is checked when the trainer is built (`MultiTurn.__init__`), before any model is
loaded: the tools' schemas, the chat template's support for tools and its tool-call format, the environments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_trainer.data.checks import is_conversational
from grpo_trainer.rollout import capture
from grpo_trainer.rollout.multiturn.chat import ToolSuffix, check_renders_tools
from grpo_trainer.rollout.multiturn.environments import EMPTY_PROMPT, Environments
from grpo_trainer.rollout.multiturn.loop import (
    Generate,
    ToolCounts,
    Trajectory,
    left_padded,
    run_tool_loop,
    sampled_turns,
    to_rollout,
)
from grpo_trainer.rollout.multiturn.rollout_func import RolloutFuncOutput
from grpo_trainer.rollout.multiturn.tool_calls import select_parser
from grpo_trainer.rollout.multiturn.tools import check_tools, tool_list, toolbox
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import PromptSettings
from grpo_trainer.rollout.types import PromptBatch, Rollout, SamplerRecord

__all__ = ["Episode", "MultiTurn", "TurnSettings"]


@dataclass(frozen=True)
class TurnSettings:
    """The config's fields a multi-turn round reads."""

    prompts: PromptSettings = field(default_factory=PromptSettings)
    max_completion_length: int = 512  # the whole rollout's token budget, tool results included
    max_iterations: int | None = None  # `max_tool_calling_iterations`
    # A rollout_func's `logprobs` are an inference engine's, for the importance-sampling correction (TRL's rule with
    # `use_vllm`: its rollout_func samples with the trainer's vLLM).
    engine_logprobs: bool = False


@dataclass
class Episode:
    """A multi-turn generation round on one process."""

    rollout: Rollout
    prompts: list  # as the model saw them (with what `reset` appended)
    completions: list  # per rollout: chat messages (assistant turns and tool results), or text for text prompts
    reward_kwargs: dict[str, list]  # one value per rollout, for the reward functions
    tool_counts: ToolCounts | None  # None when no tools are offered


class MultiTurn:
    """The tools and environments of a run, checked, and the round that uses them (and a `rollout_func`)."""

    def __init__(self, tokenizer: Any, settings: TurnSettings, tools: Sequence[Callable] | None,
                 environments: Environments | None) -> None:
        """`environments`: built from `environment_factory` first, since their rewards are checked with
        `reward_funcs` before the tokenizer is loaded."""
        self.tokenizer = tokenizer
        # Until `attach_model`: the tokenizer's EOS, which is what chat templates end turns with.
        self.eos_token_ids, self.max_context = [tokenizer.eos_token_id], None
        self.chat_template_kwargs = settings.prompts.chat_template_kwargs or {}
        self.max_prompt_length = settings.prompts.max_prompt_length
        self.max_completion_length = settings.max_completion_length
        self.pad_to_multiple_of = settings.prompts.pad_to_multiple_of
        self.max_iterations = settings.max_iterations
        self.engine_logprobs = settings.engine_logprobs
        standalone = tool_list(tools)
        check_tools(standalone)
        self.environments = environments
        self.tools = environments.all_tools if environments else standalone
        self.parser = self.suffix = None
        if self.tools:
            check_renders_tools(tokenizer, self.chat_template_kwargs)
            self.parser = select_parser(tokenizer, self.chat_template_kwargs)
            self.suffix = ToolSuffix(tokenizer, self.eos_token_ids, self.chat_template_kwargs)
            self.suffix([{"role": "tool", "name": self.tools[0].__name__, "content": "0"}])  # fails now, not mid-run
        self.last_environments: list | None = None  # the latest round's instances (TRL's `trainer.environments`)

    def attach_model(self, eos_token_ids: Sequence[int], max_context: int | None) -> None:
        """The loaded model's facts: every EOS id that ends a turn, and its context length (None: unbounded)."""
        self.eos_token_ids, self.max_context = list(eos_token_ids), max_context
        if self.suffix is not None:
            self.suffix.eos = set(self.eos_token_ids)

    def check_dataset(self, dataset: Any, name: str) -> None:
        """Tools and environments talk in chat messages: text prompts are refused."""
        if dataset is None or not (self.tools or self.environments):
            return
        first = next(iter(dataset), None)
        prompt = first.get("prompt") if isinstance(first, dict) else None
        if prompt is not None and not is_conversational(prompt):
            raise ValueError(f"{name} has text prompts, but tools and environments work on chat messages: give the "
                             "prompts as lists of {'role', 'content'} messages.")

    def run(self, rows: list[dict], generate: Generate, first_turn: Callable[[list], RolloutFuncOutput] | None,
            device: torch.device | str) -> Episode:
        """One round for this process's `rows`: `generate` runs a turn on the rollout backend, `first_turn` (the
        trainer's rollout_func, if any) replaces the first."""
        envs = self.environments
        prompts = [row.get("prompt", EMPTY_PROMPT) if envs else row["prompt"] for row in rows]
        reward_kwargs: dict[str, list] = {}
        names: list = [None] * len(rows)
        if envs:
            names = envs.names(rows)
            self.last_environments = envs.instances(names)
            prompts = envs.reset(self.last_environments, rows, prompts)
            reward_kwargs["environments"] = self.last_environments
        offered = [envs.tools[n] for n in names] if envs else [self.tools] * len(rows)
        if (self.tools or envs) and not is_conversational(prompts[0]):
            raise ValueError("tools and environments work on chat messages, but this batch has text prompts.")
        if first_turn is not None:
            output = first_turn(prompts)
            reward_kwargs.update(output.extra)
            out = self._from_token_lists(output, device)
        else:
            batch = tokenize_prompts(self.tokenizer, prompts, self.max_prompt_length, self.chat_template_kwargs,
                                     self.pad_to_multiple_of, tools=offered if self.tools else None)
            out = generate(batch.to(device), None, False)
        if not self.tools:
            texts = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)  # padded with pad
            completions = [[{"role": "assistant", "content": t}] for t in texts] if is_conversational(prompts[0]) \
                else texts
            return Episode(capture.drop_for_tool_results(out), prompts, completions, reward_kwargs, None)
        out, completions, counts = self._tool_loop(out, offered, names, generate)
        return Episode(capture.drop_for_tool_results(out), prompts, completions, reward_kwargs, counts)

    def _tool_loop(self, first: Rollout, offered: list, names: list, generate: Generate
                   ) -> tuple[Rollout, list, ToolCounts]:
        trajectories = []
        for i, (ids, ended, logps) in enumerate(sampled_turns(first)):
            trajectory = Trajectory(first.prompt_ids[i][first.prompt_mask[i].bool()].tolist())
            trajectory.add_turn(ids, ended, self.parser, offered[i], logps)
            if first.env_mask is not None:  # a rollout_func's own mask for its first turn
                trajectory.env_mask = first.env_mask[i, :len(ids)].tolist()
            trajectories.append(trajectory)
        toolboxes = self.environments.toolboxes(self.last_environments, names) if self.environments \
            else [toolbox(self.tools)] * len(names)
        counts = run_tool_loop(trajectories, generate, self.parser, toolboxes, offered, self.suffix,
                               self.tokenizer.pad_token_id, max_iterations=self.max_iterations,
                               max_completion_length=self.max_completion_length, max_context=self.max_context)
        completions = [t.messages for t in trajectories]
        if counts.results_kept == 0:  # no tool wrote a token: the first turn is the whole rollout, as sampled
            return first, completions, counts
        prompts = PromptBatch(first.prompt_ids, first.prompt_mask)
        return to_rollout(prompts, trajectories, self.tokenizer.pad_token_id, first.sampler.kind), completions, counts

    def _from_token_lists(self, output: RolloutFuncOutput, device: torch.device | str) -> Rollout:
        """A rollout_func's token lists as a `Rollout` (TRL: every returned completion token is in the completion;
        it is truncated when its last token is neither EOS nor padding). Its `logprobs` are the behaviour policy's,
        the sampler's own (`SamplerRecord.logps`: TRL's `sampling_per_token_logps`, which the off-policy mask and,
        with vLLM, the importance-sampling correction read); None is NaN (no value), padding 0."""
        pad = self.tokenizer.pad_token_id
        masks = output.env_mask or [[1] * len(c) for c in output.completion_ids]
        logprobs = output.logprobs if self.engine_logprobs else [None] * len(masks)
        trajectories = [Trajectory(p, list(c), list(m), ended=bool(c) and c[-1] in {*self.eos_token_ids, pad},
                                   engine_logps=None if lp is None else [float(v) for v in lp])
                        for p, c, m, lp in zip(output.prompt_ids, output.completion_ids, masks, logprobs)]
        out = to_rollout(left_padded(output.prompt_ids, pad).to(device), trajectories, pad, "rollout_func")
        logps = torch.zeros(out.completion_ids.shape, dtype=torch.float32)
        for row, values in enumerate(output.logprobs):
            logps[row, :len(values)] = torch.tensor([math.nan if v is None else float(v) for v in values])
        out = dataclasses.replace(out, sampler=SamplerRecord("rollout_func", logps=logps.to(out.completion_ids.device)))
        return out if output.env_mask is not None else dataclasses.replace(out, env_mask=None)
