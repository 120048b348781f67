"""The skip budget (tests/skip_budget.py): a run in which a test skips that the allow-list does not name fails; a
listed skip passes; with xdist the controller decides."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_budget import allowed_patterns, unlisted

ROOT = Path(__file__).resolve().parents[1]
SUITE = """
import pytest

def test_runs():
    assert True

@pytest.mark.skip(reason="needs a GPU")
def test_gpu_only():
    pass

def test_skips_itself():
    pytest.skip("nothing to test here")
"""


def _run(tmp_path, allowed: str, *args) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "allowed.txt").write_text(allowed)
    env = {**{k: v for k, v in os.environ.items() if k != "GRPO_TRAINER_WRITE_SKIPS"}, "PYTHONPATH": str(ROOT),
           "GRPO_TRAINER_ALLOWED_SKIPS": str(tmp_path / "allowed.txt")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.skip_budget", "-p", "no:cacheprovider",
                           str(tmp_path / "test_suite.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_patterns_and_matching():
    text = "# header\n\ntests/gpu/*  # no GPU on CI\ntests/a.py::test_b[x]  # why\n"
    assert allowed_patterns(text) == ["tests/gpu/*", "tests/a.py::test_b[x]"]
    skipped = [("tests/gpu/test_c.py::test_d", "r"), ("tests/a.py::test_b[x]", "r"), ("tests/e.py::test_f", "r")]
    assert unlisted(skipped, allowed_patterns(text)) == [("tests/e.py::test_f", "r")]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_an_unlisted_skip_fails_the_run_and_a_listed_one_does_not(tmp_path, workers):
    failing = _run(tmp_path, "test_suite.py::test_gpu_only  # no GPU\n", *workers)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "skip budget: 1 test(s) skipped" in failing.stdout and "test_skips_itself" in failing.stdout
    passing = _run(tmp_path, "test_suite.py::test_gpu_only  # no GPU\ntest_suite.py::test_skips_*  # why\n",
                   *workers)
    assert passing.returncode == 0, passing.stdout + passing.stderr
