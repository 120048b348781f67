"""`HealthMonitor`: the rules (`diagnosis.rules`) over a run's log steps, one warning when a condition sets in, one note
when it clears, and the summary of the run.

Decisions:

1. Hysteresis, so a metric that hovers at its threshold gives no storm of warnings: a condition is diagnosed after
   `patience` log steps over the threshold (events, a gradient spike or a non-finite step, at once), and clears only
   after `recovery` log steps in a row past the clear level (`hysteresis` x the threshold; for events, without
   one). One warning per onset; each onset and clearing is an `Episode` of the summary.
2. The monitor reads log dicts and keeps a short history (what the trends need) and the reward's course, nothing
   else: the trainer calls `observe` from its `log`, `grpo-train doctor` calls it on the rows of a log file, and both
   get the same episodes.
3. The summary says what was diagnosed, from which step, whether it cleared (and when), the worst value, and how
   the run stopped; it is text for the console, the run log and the model card, and a JSON record for
   `metrics.jsonl` (`Summary.record`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from grpo_trainer.diagnosis.rules import RULES, TITLES, Finding, Past, Reading
from grpo_trainer.diagnosis.settings import HealthSettings, RunFacts

__all__ = ["Episode", "HealthMonitor", "Note", "Summary", "TRAINING_KEYS"]

# A log step is a training step's when it carries one of these (the end-of-training totals and eval rows do not).
TRAINING_KEYS = ("loss", "reward", "grad_norm", "entropy")


class Note(NamedTuple):
    """A message of `observe`: a condition that set in (`onset`: a warning) or one that cleared."""

    onset: bool
    text: str


@dataclass
class Episode:
    """One diagnosis from its onset to its clearing (`end_step` None: still active)."""

    finding: Finding  # at onset
    start_step: int
    worst: float
    end_step: int | None = None

    @property
    def name(self) -> str:
        return self.finding.diagnosis + (f" ({self.finding.subject})" if self.finding.subject else "")

    def record(self) -> dict[str, Any]:
        f = self.finding
        return {"diagnosis": f.diagnosis, "subject": f.subject, "metric": f.metric, "threshold": f.threshold,
                "value_at_onset": f.value, "worst": self.worst, "start_step": self.start_step,
                "end_step": self.end_step, "cleared": self.end_step is not None, "cause": f.cause, "fix": f.fix}


@dataclass
class _Condition:
    over: int = 0  # log steps in a row with the condition on
    under: int = 0  # ... with it off
    episode: Episode | None = None


@dataclass(frozen=True)
class Summary:
    """What the monitor diagnosed over a run (decision 3)."""

    episodes: tuple[Episode, ...]
    log_steps: int
    first_step: int | None
    last_step: int | None
    stopped: str  # "finished", "interrupted by SIGTERM at step 12", ...
    facts: RunFacts = field(default_factory=RunFacts)

    def lines(self) -> list[str]:
        span = f"steps {self.first_step}-{self.last_step}, " if self.first_step is not None else ""
        head = f"Training health ({span}{self.log_steps} log steps checked; {self.stopped}): "
        if not self.episodes:
            return [head + "no problem diagnosed."]
        count = len(self.episodes)
        lines = [head + f"{count} {'diagnoses' if count > 1 else 'diagnosis'}."]
        for episode in self.episodes:
            f = episode.finding
            when = f"steps {episode.start_step}-{episode.end_step}, cleared" if episode.end_step is not None \
                else f"from step {episode.start_step}, not cleared"
            lines.append(f"- {episode.name}: {TITLES[f.diagnosis]}; {when}; worst {f.metric} = {episode.worst:.3g} "
                         f"(threshold {f.threshold:.3g}). Fix: {f.fix}.")
        return lines

    def record(self) -> dict[str, Any]:
        """The summary as one `metrics.jsonl` record's value (under the key `health`)."""
        return {"log_steps": self.log_steps, "first_step": self.first_step, "last_step": self.last_step,
                "stopped": self.stopped, "diagnoses": [e.record() for e in self.episodes],
                "facts": self.facts.as_dict()}


class HealthMonitor:
    """`observe(step, logs)` at each training log step; `summary(stopped)` at the end (decisions 1-3)."""

    def __init__(self, settings: HealthSettings | None = None, facts: RunFacts | None = None) -> None:
        self.settings, self.facts = settings or HealthSettings(), facts or RunFacts()
        self.past = Past()  # the last 3 x trend_window log steps and the reward's course (`rules.Past`)
        self.conditions: dict[str, _Condition] = {}
        self.episodes: list[Episode] = []
        self.log_steps, self.first_step, self.last_step = 0, None, None

    def observe(self, step: int, logs: Mapping[str, Any]) -> list[Note]:
        """Read one log step's metrics; returns the warnings of conditions that set in and the notes of those that
        cleared (empty for a log step that is not a training step's)."""
        if not any(key in logs for key in TRAINING_KEYS):
            return []
        row = {**logs, "step": step}
        messages = []
        for rule in RULES.values():
            for reading in rule(row, self.past, self.settings, self.facts):
                message = self._update(step, reading)
                if message:
                    messages.append(message)
        self.past = self.past.after(row, keep=3 * self.settings.trend_window)
        self.log_steps += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        return messages

    def _update(self, step: int, reading: Reading) -> Note | None:
        condition = self.conditions.setdefault(reading.key, _Condition())
        f, s = reading.finding, self.settings
        condition.over = condition.over + 1 if reading.state == "on" else 0
        condition.under = condition.under + 1 if reading.state == "off" else 0
        episode = condition.episode
        if episode is None and condition.over >= (1 if reading.event else s.patience):
            condition.episode = Episode(f, step, f.value)
            self.episodes.append(condition.episode)
            comparison = ">=" if f.above else "<="
            return Note(True, f"health: {TITLES[f.diagnosis]}{f' ({f.subject})' if f.subject else ''} since step "
                              f"{step}: {f.metric} = {f.value:.3g} {comparison} {f.threshold:.3g} ({f.evidence}). "
                              f"Probable cause: {f.cause}. Fix: {f.fix}.")
        if episode is None:
            return None
        episode.worst = max(episode.worst, f.value) if f.above else min(episode.worst, f.value)
        if condition.under >= s.recovery:
            episode.end_step, condition.episode = step, None
            return Note(False, f"health: {TITLES[f.diagnosis]}{f' ({f.subject})' if f.subject else ''} cleared at "
                               f"step {step} ({f.metric} = {f.value:.3g}).")
        return None

    def summary(self, stopped: str = "finished") -> Summary:
        episodes = tuple(dataclasses.replace(e) for e in self.episodes)
        return Summary(episodes, self.log_steps, self.first_step, self.last_step, stopped, self.facts)
