"""SIGTERM / SIGINT while a step is stuck (a reward function waiting on a server that never answers): the process
ends within signal_grace_period, having saved the last finished step; a second signal ends it at once. Each run is
a subprocess under a time limit, killed if it outlives it."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grpo_trainer.runtime.checkpoints import MANIFEST, latest_complete
from tests.helpers import copy_task_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT = 240  # import and two training steps on a loaded machine

STUCK_SCRIPT = textwrap.dedent('''
    import ctypes, sys, time
    from grpo_trainer import GRPOConfig, GRPOTrainer
    from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model, make_tokenizer

    def wait_forever():
        if sys.argv[3] == "python":  # a blocking call that Python interrupts to run signal handlers
            time.sleep(3600)
        # A C library that never returns to the interpreter: relocking a normal pthread mutex deadlocks (the GIL
        # is released, as in any C extension that blocks), so no Python-level signal handler ever runs here.
        libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeroed = PTHREAD_MUTEX_INITIALIZER
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)

    def reward_from_a_dead_server(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 2:  # the rollout of step 3 waits forever
            print("STUCK", flush=True)
            wait_forever()
        return copy_digits_reward(completions, **kwargs)

    tokenizer = make_tokenizer()
    args = GRPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, learning_rate=0.01, max_steps=100, save_strategy="no",
                      report_to="none", disable_tqdm=True, seed=0, signal_grace_period=float(sys.argv[2]),
                      async_rollouts=int(sys.argv[4]))
    trainer = GRPOTrainer(make_tiny_model(tokenizer, seed=7), reward_from_a_dead_server, args=args,
                          train_dataset=copy_digits_dataset(32), processing_class=tokenizer)
    trainer.train()
    print("RETURNED", flush=True)
''')


class Run:
    """A training subprocess whose output lines arrive on a queue, so waiting for one can time out."""

    def __init__(self, tmp_path, grace_period, stuck_in="python", async_rollouts=0):
        script = tmp_path / "train.py"
        script.write_text(STUCK_SCRIPT)
        env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.output_dir = tmp_path / "out"
        command = [sys.executable, str(script), str(self.output_dir), str(grace_period), stuck_in, str(async_rollouts)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines, self.seen = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, text, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r} within {timeout} s; output:\n{''.join(self.seen)[-3000:]}")

    def exit_code(self, timeout):
        """The exit code, or None if the process was still running after `timeout` s (it is then killed)."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def output(self):
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)[-3000:]

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.mark.parametrize("signum, stuck_in, async_rollouts", [
    (signal.SIGTERM, "python", 0), (signal.SIGINT, "python", 0),
    pytest.param(signal.SIGTERM, "C", 0, marks=pytest.mark.skipif(sys.platform != "linux", reason="glibc pthreads")),
    # asynchronous rollouts: the reward hangs on the producer thread (round 3, sampled while step 3 trains); the
    # main thread waits for it before the optimizer step, with the last finished step intact
    (signal.SIGTERM, "python", 1),
])
def test_a_stuck_step_ends_within_the_grace_period_with_the_last_step_saved(tmp_path, tokenizer, toy_dataset,
                                                                            signum, stuck_in, async_rollouts):
    run = Run(tmp_path, grace_period=3, stuck_in=stuck_in, async_rollouts=async_rollouts)
    try:
        run.wait_for("STUCK", START_TIMEOUT)
        sent = time.monotonic()
        run.process.send_signal(signum)
        code = run.exit_code(timeout=120)  # 3 s of grace, then one small checkpoint
        waited = time.monotonic() - sent
    finally:
        run.kill()
    output = run.output()
    assert code == 128 + signum, output
    assert waited >= 3, output  # the step had its grace period first
    assert "did not end within signal_grace_period (3.0 s); exiting after saving the last finished" in output
    assert "RETURNED" not in output
    checkpoint = run.output_dir / "checkpoint-2"
    assert latest_complete(str(run.output_dir)) == str(checkpoint) and (checkpoint / MANIFEST).is_file()
    if stuck_in == "python" and signum == signal.SIGTERM:  # what was saved resumes (synchronously here)
        resumed = copy_task_trainer(run.output_dir, tokenizer, toy_dataset, max_steps=3)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 3


def test_a_second_signal_ends_the_run_at_once(tmp_path):
    run = Run(tmp_path, grace_period=600)
    try:
        run.wait_for("STUCK", START_TIMEOUT)
        run.process.send_signal(signal.SIGTERM)
        run.wait_for("SIGTERM received", 30)
        sent = time.monotonic()
        run.process.send_signal(signal.SIGTERM)
        code = run.exit_code(timeout=60)
        waited = time.monotonic() - sent
    finally:
        run.kill()
    output = run.output()
    assert code == 128 + signal.SIGTERM, output
    assert waited < 60 and "SIGTERM received a second time: exiting now." in output
    assert latest_complete(str(run.output_dir)) is None  # nothing was half-saved either
