"""A run's logs read back for `grpo-train doctor`: this package's `metrics.jsonl` (`reporting.run_log`) or any
`transformers.Trainer` run's `trainer_state.json` (its `log_history`, TRL's metric names), replayed through the health
monitor; and the plot of the metrics behind each diagnosis.

Decisions:

1. In a run directory, `metrics.jsonl` wins (it is written at every log step, so it is current while the run goes
   on); else `trainer_state.json`; else the newest `checkpoint-*/trainer_state.json` (the Trainer writes the state
   only into checkpoints).
2. A file that cannot be read or parsed is a `LogError` naming the file (and the line); so is a directory without any.
3. The plot uses matplotlib's object API on an Agg canvas, as `reporting.run_log` does: no display, no change to the
   caller's backend.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from grpo_trainer.diagnosis.monitor import TRAINING_KEYS, Episode, HealthMonitor, Note, Summary
from grpo_trainer.diagnosis.rules import number
from grpo_trainer.diagnosis.settings import HealthSettings, RunFacts

__all__ = ["LogError", "RunLog", "find_log", "plot_episodes", "read_log", "replay"]

# Diagnoses whose finding's value is the plotted metric's own value, so the threshold is a line on its panel.
_THRESHOLD_LINES = {"truncation", "zero_variance", "reward_missing", "entropy_collapse", "clipping", "ess_collapse",
                    "nonfinite"}


class LogError(ValueError):
    """A run directory or log file that cannot be read (decision 2)."""


class RunLog:
    """A log file's training rows (oldest first) and, for a finished run of this package, its health summary."""

    def __init__(self, path: str, rows: list[dict[str, Any]], summary: dict[str, Any] | None) -> None:
        self.path, self.rows, self.summary = path, rows, summary

    @property
    def facts(self) -> RunFacts:
        """The run's settings as its summary recorded them (none for a running run or a TRL one)."""
        return RunFacts.from_dict((self.summary or {}).get("facts", {}))


def find_log(run_dir: str) -> str:
    """The log file of `run_dir` (decision 1)."""
    if not os.path.isdir(run_dir):
        raise LogError(f"{run_dir!r} is not a directory (give the run's output_dir).")
    for name in ("metrics.jsonl", "trainer_state.json"):
        if os.path.isfile(path := os.path.join(run_dir, name)):
            return path
    states = glob.glob(os.path.join(run_dir, "checkpoint-*", "trainer_state.json"))
    numbered = [(int(m.group(1)), p) for p in states if (m := re.search(r"checkpoint-(\d+)", p))]
    if numbered:
        return max(numbered)[1]
    raise LogError(f"no metrics.jsonl or trainer_state.json in {run_dir!r} (nor in a checkpoint-*/ folder): "
                   "grpo-train writes metrics.jsonl, a transformers.Trainer run writes trainer_state.json.")


def read_log(path: str) -> RunLog:
    """The training rows of a `metrics.jsonl` or `trainer_state.json` (decision 2 for what cannot be read)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise LogError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    if path.endswith(".jsonl"):
        entries = []
        for number_, line in enumerate(text.splitlines(), 1):
            if line.strip():
                entries.append(_parse(line, f"{path!r} line {number_}"))
    else:
        state = _parse(text, repr(path))
        entries = state.get("log_history") if isinstance(state, dict) else None
        if not isinstance(entries, list):
            raise LogError(f"{path!r} has no log_history list: it is not a transformers.Trainer trainer_state.json.")
    summary = next((e["health"] for e in reversed(entries) if isinstance(e, dict) and isinstance(e.get("health"),
                                                                                                  dict)), None)
    rows = [e for e in entries if isinstance(e, dict) and any(key in e for key in TRAINING_KEYS)]
    return RunLog(path, rows, summary)


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LogError(f"cannot read {where}: not JSON ({exc.msg} at column {exc.colno}).") from None


def replay(rows: Iterable[dict[str, Any]], settings: HealthSettings | None = None, facts: RunFacts | None = None
           ) -> tuple[HealthMonitor, list[Note]]:
    """The monitor after `rows`, and every note it gave on the way (what the live run logged)."""
    monitor, messages = HealthMonitor(settings, facts), []
    for index, row in enumerate(rows):
        messages += monitor.observe(int(row.get("step", index + 1)), row)
    return monitor, messages


def plot_episodes(rows: list[dict[str, Any]], summary: Summary, png_path: str) -> str | None:
    """One panel per metric behind a diagnosis: its values against the step, each episode shaded, the threshold
    as a dashed line where it is the metric's own (decision 3). None when nothing was diagnosed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels: dict[str, list[Episode]] = {}
    for episode in summary.episodes:
        panels.setdefault(episode.finding.metric, []).append(episode)
    if not panels:
        return None
    panels = dict(list(panels.items())[:6])
    figure = Figure(figsize=(4 * len(panels), 3.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (metric, episodes) in zip(axes_list, panels.items()):
        points = [(row["step"], value) for row in rows if "step" in row and (value := number(row, metric)) is not None]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=2)
        for episode in episodes:
            axes.axvspan(episode.start_step, episode.end_step or summary.last_step or episode.start_step,
                         color="tab:red", alpha=0.15)
            if episode.finding.diagnosis in _THRESHOLD_LINES:
                axes.axhline(episode.finding.threshold, color="tab:red", linestyle="--", linewidth=1)
        axes.set_title(f"{metric}\n{', '.join(sorted({e.name for e in episodes}))}", fontsize=9)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    figure.savefig(png_path, dpi=90)
    return png_path
