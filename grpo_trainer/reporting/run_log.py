"""What a run leaves on disk to look at: `metrics.jsonl` (one line per log step) and `metrics.png`.

Decisions:

1. A `TrainerCallback`, not trainer code: it sees exactly the dicts every other logger (TensorBoard, W&B) sees,
   and any `transformers.Trainer` can use it.
2. Only the main process writes. A fresh run (global step 0) starts a new file; a resumed run appends.
3. The plot uses matplotlib's object API on an Agg canvas, never `pyplot`, so it neither needs a display nor
   changes the backend of the user's own session.
"""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback, TrainingArguments

__all__ = ["RunLogCallback", "plot_metrics", "read_metrics", "reward_rise"]

PANELS = (  # (title, metric key, band half-width key)
    ("reward (band: ± its std over the round)", "reward", "reward_std"),
    ("KL to the reference model", "kl", None),
    ("completion length (tokens)", "completions/mean_length", None),
)


class RunLogCallback(TrainerCallback):
    """Appends every `on_log` dict, with its step, to `{output_dir}/metrics.jsonl`; draws `metrics.png` at the end."""

    def __init__(self, output_dir: str | None = None, filename: str = "metrics.jsonl",
                 plot_name: str | None = "metrics.png") -> None:
        self.output_dir, self.filename, self.plot_name = output_dir, filename, plot_name

    def _path(self, args: TrainingArguments, name: str) -> str:
        return os.path.join(self.output_dir or args.output_dir, name)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            path = self._path(args, self.filename)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if state.global_step == 0 and os.path.exists(path):
                os.remove(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with open(self._path(args, self.filename), "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}, default=float) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.plot_name:
            plot_metrics(self._path(args, self.filename), self._path(args, self.plot_name))


def read_metrics(path: str) -> list[dict]:
    """The training log steps of a metrics file (rows that carry a `reward`)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "reward" in row]


def reward_rise(rows: list[dict], fraction: float = 0.1) -> tuple[float, float]:
    """Mean reward over the first and over the last `fraction` of the log steps (at least one step each)."""
    rewards = [row["reward"] for row in rows if row["reward"] is not None and not math.isnan(row["reward"])]
    if not rewards:
        return math.nan, math.nan
    k = max(1, round(len(rewards) * fraction))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def plot_metrics(metrics_path: str, png_path: str) -> str | None:
    """Reward (± its std over the round), KL and mean completion length against the step. Returns the
    PNG's path, or None when the file has no training log step yet."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    if not rows:
        return None
    figure = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    steps = [row["step"] for row in rows]
    for axes, (title, key, band) in zip(figure.subplots(1, len(PANELS)), PANELS):
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if key not in rows[0]:
            axes.text(0.5, 0.5, "not logged (beta = 0: no KL term)" if key == "kl" else "not logged",
                      ha="center", va="center", transform=axes.transAxes, color="gray")
            continue
        values = [_number(row.get(key)) for row in rows]  # a metric with no value in a window is logged as None
        axes.plot(steps, values, marker="o", markersize=2)
        if band and band in rows[0]:
            spread = [_number(row.get(band)) for row in rows]
            axes.fill_between(steps, [v - s for v, s in zip(values, spread)],
                              [v + s for v, s in zip(values, spread)], alpha=0.2)
    figure.suptitle(os.path.dirname(os.path.abspath(metrics_path)), fontsize=9, color="gray")
    figure.savefig(png_path, dpi=100)
    return png_path


def _number(value: float | None) -> float:
    return math.nan if value is None else value
