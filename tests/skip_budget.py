"""A pytest plugin for the suite at the newest releases (scripts/test.sh loads it with `-p tests.skip_budget`): the
run fails when a test skips that tests/allowed_skips.txt does not list, so a new skip cannot hide a failure. Each
line there is a node id pattern (`*` matches anything; brackets are literal, as in parametrized ids), then `#` and
why it may skip on CI's CPU machine.

    python -m pytest -p tests.skip_budget            # fails on an unlisted skip
    GRPO_TRAINER_WRITE_SKIPS=1 python -m pytest ...  # prints the skips it saw as allow-list lines instead
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ALLOWED = Path(os.environ.get("GRPO_TRAINER_ALLOWED_SKIPS") or Path(__file__).with_name("allowed_skips.txt"))


def allowed_patterns(text: str) -> list[str]:
    """The node id patterns of an allow-list's text (blank lines and comments dropped)."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def matches(node: str, pattern: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), node) is not None


def unlisted(skipped: list[tuple[str, str]], patterns: list[str]) -> list[tuple[str, str]]:
    """The (node id, reason) pairs no pattern allows."""
    return [(node, reason) for node, reason in skipped if not any(matches(node, p) for p in patterns)]


class SkipBudget:
    def __init__(self) -> None:
        self.skipped: list[tuple[str, str]] = []

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report) -> None:  # with xdist: on the controller, for every worker's reports
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append((report.nodeid, str(reason)))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller decides
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if os.environ.get("GRPO_TRAINER_WRITE_SKIPS"):
            for node, reason in sorted(set(self.skipped)):
                reporter.write_line(f"{node}  # {reason}")
            return
        extra = unlisted(self.skipped, allowed_patterns(ALLOWED.read_text()))
        if extra:
            reporter.write_line(f"skip budget: {len(extra)} test(s) skipped that {ALLOWED.name} does not allow "
                                "(a skip must not hide a failure: fix the test, or list it with the reason):",
                                red=True)
            for node, reason in extra:
                reporter.write_line(f"  {node}  # {reason}", red=True)
            if session.exitstatus == 0:
                session.exitstatus = 1


def pytest_configure(config) -> None:
    config.pluginmanager.register(SkipBudget(), "skip_budget_state")
