"""Sampled completions kept for people to read: a `rich` table at each log step and a JSONL file per step.

Only the main process writes. Rows are gathered from every process only when `log_completions=True`, so the
default run pays nothing for this.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque

from torch import Tensor

__all__ = ["CompletionLog"]


class CompletionLog:
    """Rolling buffer of the latest generation rounds' (prompt, completion, rewards, advantage) rows."""

    def __init__(self, output_dir: str | None, reward_names: list[str], num_to_print: int | None,
                 max_rows: int = 4096) -> None:
        self.directory = os.path.join(output_dir or ".", "completions")
        self.reward_names, self.num_to_print = reward_names, num_to_print
        self.rows: deque[dict] = deque(maxlen=max_rows)

    def add(self, prompts: list, completions: list, rewards: Tensor, advantages: Tensor) -> None:
        """Rows of one round: `B` prompts and completions, `[B, F]` rewards, `[B]` advantages."""
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            scores = {n: (None if math.isnan(v) else v) for n, v in zip(self.reward_names, rewards[i].tolist())}
            self.rows.append({"prompt": prompt, "completion": text, **scores, "advantage": float(advantages[i])})

    def flush(self, step: int) -> str | None:
        """Print the table and write `completions/completions_{step:05d}.jsonl`; returns the file's path."""
        if not self.rows:
            return None
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"completions_{step:05d}.jsonl")
        with open(path, "w") as f:
            for row in self.rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        self._print(step)
        self.rows.clear()
        return path

    def _print(self, step: int) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Completions at step {step}", show_lines=True)
        for column in ["prompt", "completion", *self.reward_names, "advantage"]:
            table.add_column(column)
        rows = list(self.rows)[: self.num_to_print] if self.num_to_print is not None else list(self.rows)
        for row in rows:
            table.add_row(*[_cell(row[c]) for c in ["prompt", "completion", *self.reward_names, "advantage"]])
        Console().print(table)


def _cell(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
