"""What reward functions log while they score a round, through the `log_extra` and `log_metric` keyword arguments
of TRL's reward-function contract.

`log_extra(column, values)` adds a column to the completions table (one value per completion the function was
given); `log_metric(name, value)` records a scalar that is logged with the other metrics. Both are held here until
the round is gathered over processes.

Decisions:

1. Names are gathered from every process and walked in sorted order, so every process makes the same collective
   calls in the same order even when only some of them logged a name.
2. A column a process did not log is None on its rows. A column with more or fewer values than completions is an
   error naming the column: a silently shifted column would pair values with the wrong completions.
3. A metric's value for a round is the mean of every value logged for it on every process (their sum over their
   count), as TRL computes it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["RewardLogs"]

GatherObject = Callable[[list], list]  # a list per process -> the processes' lists concatenated in process order


class RewardLogs:
    """The pending `log_extra` columns and `log_metric` values of the round being scored on this process."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        """Add `values` (one per completion) to the completions table's column `column`."""
        self.columns[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Record `value` for the metric `name`; it is averaged with the round's other values and logged."""
        self.metrics[name].append(float(value))

    def gather_columns(self, rows: int, gather_object: GatherObject) -> dict[str, list[Any]]:
        """Every process's columns, each as one list over the round's rows in process order; clears the pending
        columns. `rows` is this process's number of completions. A column of the wrong length on any process
        raises on every process (none is left waiting in a collective)."""
        sizes = gather_object([(name, len(values), rows) for name, values in self.columns.items()])
        wrong = [(name, got, want) for name, got, want in sizes if got != want]
        if wrong:
            self.columns.clear()
            name, got, want = wrong[0]
            raise ValueError(f"log_extra({name!r}, ...) received {got} values in this round for {want} completions; "
                             "a reward function must log one value per completion it was given, once per round "
                             "(two reward functions logging the same column add up).")
        gathered = {name: gather_object(self.columns.get(name, [None] * rows))
                    for name in sorted({name for name, _, _ in sizes})}
        self.columns.clear()
        return gathered

    def gather_metrics(self, gather_object: GatherObject) -> dict[str, float]:
        """Each metric's mean over every value logged for it on every process this round; clears them."""
        means = {}
        for name in sorted(set(gather_object(list(self.metrics)))):
            values = self.metrics.get(name, [])
            totals = gather_object([(sum(values), len(values))])
            means[name] = sum(t for t, _ in totals) / sum(n for _, n in totals)
        self.metrics.clear()
        return means
