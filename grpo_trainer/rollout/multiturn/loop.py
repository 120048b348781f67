"""The tool loop: sample a turn, run the tools it calls, append their results, sample the next turn.

Decisions:

1. Any rollout backend drives it, through one function `generate(prompts, max_new_tokens, continuation) ->
   Rollout`: a turn is a rollout of the rows still going, each prompt being that row's whole context so far
   (prompt, earlier turns, tool results), left-padded like any prompt. The loop never needs more of a backend.
2. A rollout's completion is every turn and every tool result in order, one token sequence; `env_mask` marks the
   tokens the policy sampled (1) and those tools wrote (0). Tool tokens stay in the context (the next turns were
   sampled after them) but never in the loss.
3. The budget is TRL's: the whole completion, tool results included, is at most `max_completion_length` tokens. A
   turn may sample what its row has left; tool results that leave no room for a single sampled token, or that
   would pass the model's context length, are dropped and the rollout ends with its call.
4. At most `max_tool_calling_iterations` rounds of tool calls (None: until no rollout calls a tool). A rollout
   whose turn did not end with EOS (out of budget) calls nothing more.
5. An inference engine's log-probs (`SamplerRecord.logps` without `exact`: vLLM's) follow the tokens they belong
   to, turn after turn, so the importance-sampling correction covers multi-turn rollouts as TRL's does: a tool
   token gets 0 (its `env_mask` is 0, so it never enters the correction). When a turn came back without them, the
   rollout has none.

Shapes: `B` rollouts, `S` prompt tokens, `T` completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo_trainer.rollout.multiturn.tool_calls import ToolCallParser, tool_calls_of
from grpo_trainer.rollout.multiturn.tools import run_calls
from grpo_trainer.rollout.types import PromptBatch, Rollout, SamplerKind, SamplerRecord

__all__ = ["Generate", "Trajectory", "ToolCounts", "left_padded", "run_tool_loop", "sampled_turns", "to_rollout"]


class Generate(Protocol):
    def __call__(self, prompts: PromptBatch, max_new_tokens: int | None, continuation: bool) -> Rollout:
        """One turn of the rows of `prompts` (`max_new_tokens` None: the configured budget). `continuation`: a turn
        after tool results, whose rollout only gives tokens (no replay tensors)."""


@dataclass
class Trajectory:
    """One rollout, as lists of tokens and messages."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy, 0: written by a tool
    messages: list[dict] = field(default_factory=list)  # the completion as chat messages
    ended: bool = False  # the last turn ended with an EOS token
    # An engine's log-prob of each completion token (decision 5), 0 for tool tokens; None when some lack one.
    engine_logps: list[float] | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_turn(self, ids: list[int], ended: bool, parser: ToolCallParser, tools: Sequence[Any],
                 engine_logps: list[float] | None = None) -> None:
        prefix = self.context
        so_far = self.engine_logps if self.completion_ids else []
        self.engine_logps = None if so_far is None or engine_logps is None else so_far + engine_logps
        self.completion_ids += ids
        self.env_mask += [1] * len(ids)
        self.ended = ended
        if ids:
            self.messages.append(parser(ids, prefix, tools))


@dataclass
class ToolCounts:
    calls: int = 0
    failures: int = 0
    results_kept: int = 0  # tool-result turns appended to some completion


def left_padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> PromptBatch:
    """Token lists as a left-padded `PromptBatch` `[B, S]` (on the CPU: `generate` moves it)."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return PromptBatch(ids, mask)


def _right_padded(rows: Sequence[Sequence[int | float]], value: int | float, device: torch.device | str,
                  dtype: torch.dtype = torch.long) -> Tensor:
    width = max(1, max(len(row) for row in rows))
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out.to(device)


def sampled_turns(rollout: Rollout) -> list[tuple[list[int], bool, list[float] | None]]:
    """Each row's sampled tokens (through its first EOS), whether it ended with EOS, and the engine's log-probs of
    those tokens (None without them)."""
    masks = rollout.completion_mask.bool()
    engine = None if rollout.sampler.exact else rollout.sampler.logps  # an in-process sampler's are not carried
    logps = [None] * len(masks) if engine is None else [values[mask].tolist() for values, mask in zip(engine, masks)]
    return [(ids[mask].tolist(), not bool(truncated), values)
            for ids, mask, truncated, values in zip(rollout.completion_ids, masks, rollout.is_truncated, logps)]


def to_rollout(prompts: PromptBatch, trajectories: Sequence[Trajectory], pad_token_id: int,
               kind: SamplerKind = "engine") -> Rollout:
    """The trajectories as one `Rollout` `[B, T]` with its `env_mask`, over the first turn's prompts, sampled by a
    sampler of `kind`."""
    device = prompts.ids.device
    completions = [t.completion_ids for t in trajectories]
    completion_ids = _right_padded(completions, pad_token_id, device)
    completion_mask = _right_padded([[1] * len(c) for c in completions], 0, device)
    env_mask = _right_padded([t.env_mask for t in trajectories], 0, device)
    truncated = torch.tensor([not t.ended for t in trajectories], device=device)
    engine_logps = None
    if all(t.engine_logps is not None for t in trajectories):  # decision 5; 0 on padding, as every backend pads
        engine_logps = _right_padded([t.engine_logps for t in trajectories], 0.0, device, torch.float32)
    return Rollout(prompts.ids, prompts.mask, completion_ids, completion_mask.int(), truncated,
                   SamplerRecord(kind, logps=engine_logps), env_mask=env_mask.int())


def _append_results(trajectory: Trajectory, messages: list[dict], suffix_ids: list[int], max_completion_length: int,
                    max_context: int | None) -> int:
    """Append the tool results if a sampled token still fits after them (decision 3); the room left, else 0."""
    room = max_completion_length - len(trajectory.completion_ids) - len(suffix_ids)
    if max_context is not None:
        room = min(room, max_context - len(trajectory.context) - len(suffix_ids))
    if room < 1:
        return 0
    trajectory.messages += messages
    trajectory.completion_ids += suffix_ids
    trajectory.env_mask += [0] * len(suffix_ids)
    if trajectory.engine_logps is not None:
        trajectory.engine_logps += [0.0] * len(suffix_ids)  # never read: env_mask is 0 there (decision 5)
    return room


def run_tool_loop(trajectories: list[Trajectory], generate: Generate, parser: ToolCallParser,
                  toolboxes: Sequence[dict[str, Callable]], offered: Sequence[Sequence[Any]],
                  suffix: Callable[[list[dict]], list[int]], pad_token_id: int, *, max_iterations: int | None,
                  max_completion_length: int, max_context: int | None) -> ToolCounts:
    """Run the tools the trajectories' last turns call and continue them, in place (decisions 1-4)."""
    counts = ToolCounts()
    going = [i for i, t in enumerate(trajectories) if t.ended and tool_calls_of(t.messages[-1])]
    iteration = 0
    while going and (max_iterations is None or iteration < max_iterations):
        results = run_calls([tool_calls_of(trajectories[i].messages[-1]) for i in going],
                            [toolboxes[i] for i in going])
        budget = {}
        for i, row in zip(going, results):
            counts.calls += len(row)
            counts.failures += sum(result.failed for result in row)
            messages = [result.message() for result in row]
            room = _append_results(trajectories[i], messages, suffix(messages), max_completion_length, max_context)
            if room:
                budget[i] = room
        if not budget:
            break
        counts.results_kept += len(budget)
        rows = list(budget)
        prompts = left_padded([trajectories[i].context for i in rows], pad_token_id)
        turn = generate(prompts, max(budget.values()), True)
        for i, (ids, ended, logps) in zip(rows, sampled_turns(turn)):
            if len(ids) > budget[i]:  # sampled past this row's own budget
                ids, ended = ids[:budget[i]], False
                logps = None if logps is None else logps[:budget[i]]
            trajectories[i].add_turn(ids, ended, parser, offered[i], logps)
        going = [i for i in rows if trajectories[i].ended and tool_calls_of(trajectories[i].messages[-1])]
        iteration += 1
    return counts
