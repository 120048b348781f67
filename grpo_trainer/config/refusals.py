"""A refused combination as data: every table of refusals (the config's cross-field rules, the round source's, the
sequence-parallel group's) is a tuple of `Refusal`, checked by `check` and read by the combination matrix
(tests/matrix/factors.py), which asks each table about its rows instead of keeping a copy of the rules.

A refusal names the settings it reads (`reads`), so that a caller holding only some of them (a partial row of the
matrix) asks only the refusals it can decide; `applies` and `message` take the table's own settings object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Refusal", "check", "first"]

S = TypeVar("S")


@dataclass(frozen=True)
class Refusal(Generic[S]):
    name: str
    reads: tuple[str, ...]  # the fields of the settings it reads
    applies: Callable[[S], bool]
    message: Callable[[S], str]  # names the settings and what to use instead


def first(table: Sequence[Refusal[S]], settings: S, known: Callable[[str], bool] = lambda name: True
          ) -> Refusal[S] | None:
    """The first refusal of `table` that applies to `settings`, among those whose `reads` are all `known`."""
    return next((r for r in table if all(map(known, r.reads)) and r.applies(settings)), None)


def check(table: Sequence[Refusal[S]], settings: S, error: type[Exception] = ValueError) -> None:
    """Raise the first refusal of `table` that applies to `settings`."""
    refused = first(table, settings)
    if refused is not None:
        raise error(refused.message(settings))
