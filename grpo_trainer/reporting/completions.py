"""Sampled completions kept for people to read, in TRL's layout.

At every log step the main process writes `output_dir/completions/completions_{step:05d}.parquet` with the columns
`step, prompt, completion, <one per reward function>, <the log_extra columns>, advantage`, the same rows as JSONL
beside it (readable without pandas), prints them as a `rich` table, and logs them as a table to W&B and Trackio
when `report_to` names them and the library is importable.

Decisions:

1. The log holds the latest `generation_batch_size` completions (one round over all processes) and a log step does
   not clear it: a log step inside a round shows that round again, as TRL's log does.
2. Rows are gathered from every process only when `log_completions=True`, so a default run pays nothing here.
3. Only training rounds are logged. (TRL adds evaluation rounds to the same rows; an evaluation at a logging step
   then rewrites that step's file with them.)
4. `log_unique_prompts` keeps one row per distinct prompt in the W&B / Trackio table, as TRL does; the files keep
   every row.
5. A vision-language model's rows keep their prompt images (`log_multimodal`, on by default): not in the files,
   whose prompts show `{"type": "image"}` parts, but in `columns()["images"]` (TRL's `_logs["images"]`) and as an
   `image` column of the W&B / Trackio table, as TRL logs them.
6. `num_completions_to_print` rows are drawn at random by a generator seeded with the step, so printing leaves the
   run's `random` state alone. Missing rewards (None) are NaN in the parquet file and null in the JSONL file.
6. A multi-turn completion's tool calls are logged with their arguments as JSON text (the OpenAI chat format's
   convention): arguments of different tools have different fields, which one parquet column cannot hold as
   objects (nor an empty argument object at all).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["CompletionLog", "format_messages", "unique_prompt_rows"]


class CompletionLog:
    """The rows `(prompt, completion, rewards, advantage, log_extra columns)` of the latest round."""

    def __init__(self, output_dir: str | None, reward_names: Sequence[str], num_to_print: int | None,
                 max_rows: int, unique_prompts: bool = False, report_to: Sequence[str] = ()) -> None:
        self.directory = os.path.join(output_dir or ".", "completions")
        self.reward_names, self.num_to_print = list(reward_names), num_to_print
        self.unique_prompts = unique_prompts
        self.report_to = [report_to] if isinstance(report_to, str) else list(report_to or [])
        self.rows: deque[dict[str, Any]] = deque(maxlen=max_rows)

    def add(self, prompts: list, completions: list, rewards: Tensor, advantages: Tensor,
            extra: dict[str, list] | None = None, images: list | None = None) -> None:
        """Rows of one round over all processes: `B` prompts and completions (text or messages, images already
        stripped), rewards `[B, F]` (NaN: None), advantages `[B]`, the `log_extra` columns (`B` values each), and
        each row's prompt images (`B` lists, decision 5; None when not logged)."""
        extra = extra or {}
        for i, (score, advantage) in enumerate(zip(rewards.tolist(), advantages.tolist())):
            self.rows.append({"prompt": prompts[i], "completion": _loggable(completions[i]),
                              "rewards": dict(zip(self.reward_names, score)), "advantage": advantage,
                              "extra": {name: values[i] for name, values in extra.items()},
                              "images": None if images is None else list(images[i] or [])})

    def columns(self) -> dict[str, Any]:
        """The rows as TRL's trainer keeps them (`trainer._logs`): prompt, completion, rewards {name: values},
        advantages, extra {column: values}, and images (one list per row whose images were logged). A column some
        rows lack is None there."""
        rows = list(self.rows)
        names = list(dict.fromkeys(name for row in rows for name in row["extra"]))
        return {"prompt": [row["prompt"] for row in rows], "completion": [row["completion"] for row in rows],
                "rewards": {name: [row["rewards"][name] for row in rows] for name in self.reward_names},
                "advantages": [row["advantage"] for row in rows],
                "extra": {name: [row["extra"].get(name) for row in rows] for name in names},
                "images": [row["images"] for row in rows if row["images"] is not None]}

    def table(self, step: int) -> dict[str, list]:
        """The file's columns: step, prompt, completion, one per reward function, the extra columns, advantage."""
        logs = self.columns()
        return {"step": [step] * len(logs["prompt"]), "prompt": logs["prompt"], "completion": logs["completion"],
                **logs["rewards"], **logs["extra"], "advantage": logs["advantages"]}

    def flush(self, step: int) -> str | None:
        """Write the step's parquet and JSONL files, print the table and log it to W&B / Trackio; returns the
        parquet file's path (None before the first round)."""
        if not self.rows:
            return None
        import pandas as pd
        import pyarrow

        table = self.table(step)
        frame = pd.DataFrame(table)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"completions_{step:05d}.parquet")
        try:
            frame.to_parquet(path)
        except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError, pyarrow.ArrowNotImplementedError) as exc:
            raise ValueError(f"the completions of step {step} could not be written as parquet ({exc}); each column "
                             "(prompts, completions, each log_extra column) must hold values of one type.") from exc
        with open(path[:-len(".parquet")] + ".jsonl", "w") as f:
            for i in range(len(frame)):
                f.write(json.dumps({k: _json_value(v[i]) for k, v in table.items()}, default=str) + "\n")
        self._print(step)
        self._log_to_backends(frame)
        return path

    def _print(self, step: int) -> None:
        if self.num_to_print is not None and self.num_to_print <= 0:
            return
        try:
            from rich.console import Console
            from rich.panel import Panel
            from rich.table import Table
        except ImportError:  # rich is optional, as in TRL
            return
        logs = self.columns()
        indices = list(range(len(logs["prompt"])))
        if self.num_to_print is not None and self.num_to_print < len(indices):
            indices = sorted(random.Random(step).sample(indices, self.num_to_print))
        table = Table(show_header=True, expand=True)
        for header in ["Prompt", "Completion", *self.reward_names, "Advantage", *logs["extra"]]:
            table.add_column(header)
        for i in indices:
            table.add_row(format_messages(logs["prompt"][i]), format_messages(logs["completion"][i]),
                          *[f"{logs['rewards'][name][i]:.2f}" for name in self.reward_names],
                          f"{logs['advantages'][i]:.2f}", *[format_messages(v[i]) for v in logs["extra"].values()])
            table.add_section()
        Console().print(Panel(table, expand=False, title=f"Step {step}"))

    def _log_to_backends(self, frame: Any) -> None:
        """The table to W&B (when a run is active) and Trackio, for those `report_to` names and that import."""
        for name in ("wandb", "trackio"):
            if name not in self.report_to:
                continue
            try:
                backend = importlib.import_module(name)
            except ImportError:
                continue
            if name == "wandb" and getattr(backend, "run", None) is None:
                continue
            rows = self._with_images(frame, backend)
            rows = unique_prompt_rows(rows) if self.unique_prompts else rows
            backend.log({"completions": backend.Table(dataframe=rows)})

    def _with_images(self, frame: Any, backend: Any) -> Any:
        """`frame` with an `image` column of `backend.Image`s (decision 5), when some row has images."""
        if not any(row["images"] for row in self.rows):
            return frame
        images = [[backend.Image(image) for image in row["images"] or []] for row in self.rows]
        return frame.assign(image=images)


def unique_prompt_rows(frame: Any) -> Any:
    """The rows of a completions DataFrame whose prompt has not appeared in an earlier row (conversations are
    compared by their text)."""
    return frame[~frame["prompt"].astype(str).duplicated()]


def format_messages(value: Any) -> str:
    """A prompt or completion as text: a conversation as `ROLE` headers over each message's content and calls."""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n\n".join(f"{str(m.get('role', '')).upper()}\n{_content(m.get('content', ''))}{_calls(m)}"
                           for m in value)
    return str(value)


def _calls(message: dict) -> str:
    return "".join(f"\n-> {c['function']['name']}({c['function']['arguments']})"
                   for c in message.get("tool_calls") or [])


def _loggable(completion: Any) -> Any:
    """The completion with each tool call's arguments as JSON text (decision 6)."""
    if not isinstance(completion, list) or not any(isinstance(m, dict) and m.get("tool_calls") for m in completion):
        return completion
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], default=str)}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in completion]


def _content(content: Any) -> str:
    if isinstance(content, list):  # typed blocks: [{"type": "text", "text": ...}, {"type": "image"}]
        return "".join(b.get("text", "") if b.get("type") == "text" else f"[{b.get('type', '?').upper()}]"
                       for b in content if isinstance(b, dict))
    return str(content)


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value
