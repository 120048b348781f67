"""Stopping on SIGTERM or SIGINT: a checkpoint and a clean stop when the step ends, a bounded wait when it does not.

Decisions:

1. The first SIGTERM (what Slurm and Kubernetes send before killing a job) or SIGINT (Ctrl-C) asks the Trainer to
   save a checkpoint at the end of the current optimizer step and stop; `train()` then returns normally.
2. A step may never end (a reward function waiting on a server that died). If it has not ended `grace_period`
   seconds after the signal, the process exits with status 128 + the signal number, as a shell reports a death
   by that signal. Before exiting it saves the last finished step, when that state is intact: the main thread is
   inside a rollout or reward scoring that began before any micro-step of the current optimizer step ran
   (`between_steps`), or waits right before an optimizer step (`before_update`); and there is a single process (a
   save from a side thread must not take part in collective operations that the stuck processes never join). The
   step-end save of decision 1, once begun, is not cut short: the grace period bounds the wait for the step, not
   the save.
3. A second signal exits at once (status 128 + the signal number), also in a notebook, whose kernel then ends.
4. Python runs signal handlers in the main thread, between bytecodes: a main thread stuck inside C code (a
   network library that retries interrupted calls) would never run one. So the signals are acted on by a thread
   of their own, woken through `signal.set_wakeup_fd`; the Python-level handler only replaces the default action.
   Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread) nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

__all__ = ["SignalStop"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _noted(signum: int, frame: Any) -> None:
    """The Python-level handler: it only replaces the default action (exit, or KeyboardInterrupt); the signal
    watcher thread acts on the signal (decision 4)."""


def _exit(signum: int, message: str) -> None:
    sys.stderr.write(f"{message}\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)  # skips interpreter clean-up, which could wait on the stuck step forever


class SignalStop(TrainerCallback):
    """Decisions 1-4. The trainer marks its rollouts with `between_steps()` and trains inside `handling(...)`."""

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self.signum: int | None = None
        self._lock = threading.Lock()
        self._step_untouched = True  # no micro-step of the current optimizer step has run yet
        self._idle = False  # the main thread is in a rollout that began with the step untouched
        self._saving = False
        self._save_last_step: Callable[[], None] | None = None
        self._timer: threading.Timer | None = None

    # ----------------------------------------------------------------------------------- Trainer events

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._step_untouched = True

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._step_untouched = False  # a micro-step's gradients are accumulated

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> Any:
        self._step_untouched = True
        if self.signum is not None:
            with self._lock:
                self._saving = True
            control.should_save = True
            control.should_training_stop = True
        return control

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Around a rollout and its scoring: the model and optimizer hold the last finished step's state here when
        no micro-step of the current step has run yet (decision 2)."""
        with self._lock:
            self._idle = self._step_untouched
        try:
            yield
        finally:
            with self._lock:  # waits while the watchdog saves; the process then exits
                self._idle = False

    @contextlib.contextmanager
    def before_update(self) -> Iterator[None]:
        """Around a wait right before the optimizer step (an asynchronous rollout still reading the weights): the
        model and optimizer still hold the last finished step's state, so a stuck wait may be saved (decision 2)."""
        with self._lock:
            self._idle = True
        try:
            yield
        finally:
            with self._lock:
                self._idle = False

    # ---------------------------------------------------------------------------------------- signals

    @contextlib.contextmanager
    def handling(self, save_last_step: Callable[[], None] | None) -> Iterator[None]:
        """While training, handle SIGTERM and SIGINT (decisions 1-4). `save_last_step` saves a checkpoint of the last
        finished step from the watchdog thread; None where that is unsafe (several processes)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.signum, self._saving, self._save_last_step = None, False, save_last_step
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the interpreter's C-level handler writes to it and must never block
        previous = {signum: signal.signal(signum, _noted) for signum in SIGNALS}
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._watch, args=(reader,), name="signal watcher", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(previous_fd)
            writer.close()  # the watcher reads end-of-file and returns
            watcher.join(timeout=5)
            reader.close()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _watch(self, reader: socket.socket) -> None:
        """Decision 4: the interpreter writes each signal's number to the wakeup socket from its C-level handler,
        so this thread learns of a signal even while the main thread is stuck in C code."""
        while data := reader.recv(64):
            for signum in data:
                if signum in SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _exit(signum, f"{name} received a second time: exiting now.")
        self.signum = signum
        warnings.warn(f"{name} received: saving a checkpoint after the current optimizer step, then stopping. A step "
                      f"that has not ended within signal_grace_period ({self.grace_period} s) is abandoned; a second "
                      "signal exits at once.", stacklevel=1)
        self._timer = threading.Timer(self.grace_period, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        name = signal.Signals(self.signum).name
        with self._lock:  # held to the end: the main thread cannot start changing the weights meanwhile
            if self._saving:
                return
            saved = ""
            if self._idle and self._save_last_step is not None:
                try:
                    self._save_last_step()
                    saved = " after saving the last finished optimizer step"
                except Exception as exc:  # noqa: BLE001 - report it, then exit anyway
                    saved = f"; saving the last finished optimizer step failed ({type(exc).__name__}: {exc})"
            _exit(self.signum, f"{name}: the current step did not end within signal_grace_period "
                               f"({self.grace_period} s); exiting{saved}.")
