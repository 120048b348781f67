"""`grpo-train doctor RUN_DIR`: the training-health diagnosis of a finished or running run, from its logs.

    grpo-train doctor outputs/demo                     # this package's metrics.jsonl
    grpo-train doctor trl-run/                         # a TRL (or any transformers.Trainer) run's trainer_state.json
    grpo-train doctor run/ --reward_weights 1 0.01 --health_thresholds '{"truncated_fraction": 0.8}'

Decisions:

1. The log is replayed through the same monitor the trainer runs (`diagnosis.logs.replay`), so doctor prints what the
   run warned (or would have warned, for a TRL run or a run with `health_checks=False`) and the same summary.
2. The run's settings come from its summary record when it finished under this package; otherwise the rules that
   need them (reward weights, the gradient clip) take the flags, else TRL's defaults, and the fixes name the fields
   without their values.
3. The plot: a line of each diagnosed metric in the console (a sparkline), and `health.png` beside the log (or
   `--plot PATH`) with each episode shaded.
4. A directory or file it cannot read is one line on stderr naming it, with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from grpo_trainer.diagnosis.logs import LogError, RunLog, find_log, plot_episodes, read_log, replay
from grpo_trainer.diagnosis.monitor import Summary
from grpo_trainer.diagnosis.rules import number
from grpo_trainer.diagnosis.settings import HealthSettings, threshold_problems

__all__ = ["main", "sparkline"]

_BARS = "▁▂▃▄▅▆▇█"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-train doctor", description="Diagnose a run's health from its logs "
                                     "(metrics.jsonl, or a transformers.Trainer run's trainer_state.json).")
    parser.add_argument("run_dir", help="The run's output_dir (or a checkpoint folder).")
    parser.add_argument("--plot", help="Where to save the plot (default: health.png beside the log).")
    parser.add_argument("--no_plot", action="store_true", help="Print only, save no plot.")
    parser.add_argument("--health_thresholds", help="JSON dict of threshold overrides (docs/HEALTH.md).")
    parser.add_argument("--reward_weights", type=float, nargs="+", help="The run's reward_weights, in the order of "
                        "its reward functions (when its log does not record them).")
    parser.add_argument("--max_grad_norm", type=float, help="The run's max_grad_norm (default: what it recorded, "
                        "else 1.0).")
    return parser


def sparkline(values: list[float], width: int = 48) -> str:
    """`values` as one line of block characters, at most `width` wide (each a mean of its share)."""
    if not values:
        return ""
    size = max(1, -(-len(values) // width))
    means = [sum(chunk) / len(chunk) for chunk in (values[i:i + size] for i in range(0, len(values), size))]
    low, high = min(means), max(means)
    scale = (len(_BARS) - 1) / (high - low) if high > low else 0.0
    return "".join(_BARS[round((v - low) * scale)] for v in means)


def _settings(text: str | None) -> HealthSettings:
    try:
        overrides = json.loads(text) if text else None
    except json.JSONDecodeError as exc:
        raise LogError(f"--health_thresholds is not JSON ({exc.msg}).") from None
    problems = threshold_problems(overrides)
    if problems:
        raise LogError(problems[0])
    return HealthSettings.of(overrides)


def diagnose(args: argparse.Namespace) -> tuple[RunLog, Summary, list[str]]:
    """(the log read, its summary, the lines to print) for the parsed command line."""
    settings = _settings(args.health_thresholds)
    path = find_log(args.run_dir)
    log = read_log(path)
    if not log.rows:
        raise LogError(f"{path!r} has no training log step yet (a line with loss, reward, grad_norm or entropy).")
    facts = log.facts
    if args.reward_weights is not None:
        facts = dataclasses.replace(facts, reward_weights=tuple(args.reward_weights))
    if args.max_grad_norm is not None:
        facts = dataclasses.replace(facts, max_grad_norm=args.max_grad_norm)
    monitor, notes = replay(log.rows, settings, facts)
    recorded = (log.summary or {}).get("stopped")
    summary = monitor.summary(recorded or f"log read at step {monitor.last_step}")
    lines = [f"{path}: {summary.log_steps} training log steps", *(note.text for note in notes), "",
             *summary.lines()]
    for metric in dict.fromkeys(e.finding.metric for e in summary.episodes):
        values = [v for row in log.rows if (v := number(row, metric)) is not None]
        if values:
            lines.append(f"  {metric:<36} {sparkline(values)}  {min(values):.3g} .. {max(values):.3g}")
    return log, summary, lines


def main(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    try:
        log, summary, lines = diagnose(args)
    except LogError as exc:
        print(f"grpo-train doctor: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(lines))
    if not args.no_plot and summary.episodes:
        png = args.plot or os.path.join(args.run_dir, "health.png")
        try:
            print(f"plot: {plot_episodes(log.rows, summary, png)}")
        except OSError as exc:
            print(f"grpo-train doctor: error: cannot write the plot {png!r}: {exc.strerror or exc}", file=sys.stderr)
            raise SystemExit(2) from None
