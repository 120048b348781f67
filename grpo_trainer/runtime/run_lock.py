"""One live run per `output_dir`: a lock file that holds the training process's identity.

Decisions:

1. `train()` takes `output_dir/_grpo_trainer.lock` (JSON: pid, host, the process's start time) and removes it when
   it returns or raises. Another process that finds the lock held by a live run refuses to train, unless
   `ignore_output_dir_lock=True`: both runs then write into the folder and one may overwrite the other's
   checkpoints. (The leading underscore keeps the file out of `push_to_hub` uploads.)
2. A lock is stale, and taken over with a warning, when its file is unreadable (cut off while being written) or
   its process is gone: no process with that pid on this host, or one started at another time (the pid was
   reused). A lock from another host cannot be checked from here; it is refused, naming the file to delete if
   that run is over.
3. The same process may take its own lock again (a second trainer in one script).
4. Under `accelerate launch` only the main process takes the lock; it tells the others whether training may go
   on, so every process raises together instead of the others waiting forever at the first collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import Any

from grpo_trainer.runtime import distributed

__all__ = ["LOCK_NAME", "OutputDirInUseError", "acquire", "hold", "release"]

LOCK_NAME = "_grpo_trainer.lock"


class OutputDirInUseError(RuntimeError):
    """Another live run is training into the same `output_dir`."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    now = _start_time(pid)
    return start is None or now is None or now == start


def _identity() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def acquire(output_dir: str, ignore: bool = False) -> str | None:
    """Take the lock of `output_dir` (decisions 1-3). Returns None when this process may train, or the reason it
    may not."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    me = _identity()
    for _ in range(2):  # a second try after removing a stale lock
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "w") as f:
                json.dump(me, f)
            return None
        owner = _read(path)
        if owner is not None and owner["pid"] == me["pid"] and owner.get("host") == me["host"]:
            return None
        live = owner is not None and (owner.get("host") != me["host"] or _alive(owner["pid"], owner.get("start")))
        if live:
            where = f"pid {owner['pid']} on {owner.get('host')}, since {owner.get('since')}"
            if ignore:
                warnings.warn(f"{output_dir} is in use by another run ({where}); writing to it anyway "
                              "(ignore_output_dir_lock=True): either run may overwrite the other's checkpoints.")
                return None
            remote = "" if owner.get("host") == me["host"] else \
                " (its host cannot be checked from here: if that run is over, delete the lock file)"
            return (f"output_dir {output_dir} is in use by another run ({where}){remote}; two runs would overwrite "
                    f"each other's checkpoints. Use another output_dir, wait for that run to end, or set "
                    f"ignore_output_dir_lock=True to write into it anyway. Lock file: {path}")
        gone = "unreadable" if owner is None else f"pid {owner['pid']} has exited"
        warnings.warn(f"taking over the stale lock {path} ({gone}).")
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return f"could not take the lock {path}: another process keeps taking it."


def release(output_dir: str) -> None:
    """Remove the lock of `output_dir` if this process holds it."""
    path = os.path.join(output_dir, LOCK_NAME)
    owner = _read(path)
    if owner is not None and owner["pid"] == os.getpid() and owner.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def hold(output_dir: str, accelerator: Any, ignore: bool = False) -> Iterator[None]:
    """The lock of `output_dir` for the duration of the block (decisions 1-4); raises `OutputDirInUseError`."""
    refusal = distributed.decided_by_main(accelerator, lambda: acquire(output_dir, ignore))
    if refusal is not None:
        raise OutputDirInUseError(refusal)
    try:
        yield
    finally:
        if accelerator.is_main_process:
            release(output_dir)
