"""`tests.helpers.run_bounded`, which every multi-process test launches through: on timeout nothing it started is
left running, also a process that left the launcher's process group (as torch's elastic agent's ranks can). A rank
left behind once held DeepSpeed's op-build lock and hung every later launch of the session."""

import sys
import time

import psutil

from tests.helpers import run_bounded

ESCAPES_THE_GROUP = ("import subprocess, sys, time\n"
                     "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
                     " start_new_session=True)\n"
                     "print(child.pid, flush=True)\n"
                     "time.sleep(120)\n")


def test_a_timed_out_command_leaves_no_process_behind(tmp_path):
    log = tmp_path / "run.log"
    started = time.monotonic()
    code = run_bounded([sys.executable, "-c", ESCAPES_THE_GROUP], tmp_path, {}, log, timeout_s=5)
    assert code == -9 and time.monotonic() - started < 60
    escaped = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while _running(escaped):
        assert time.monotonic() < deadline, f"process {escaped}, started in a session of its own, still runs"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_command_that_ends_returns_its_exit_code(tmp_path):
    assert run_bounded([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, {}, tmp_path / "run.log", 60) == 3
