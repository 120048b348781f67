"""One live run per output_dir: a second run is refused while the first lives, stale locks are taken over, and the
opt-in (`ignore_output_dir_lock`) lets a run write into a folder in use."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from grpo_trainer.runtime.run_lock import LOCK_NAME, OutputDirInUseError, _start_time, acquire, release
from tests.helpers import REPO, make_trainer

HOLDER = textwrap.dedent('''
    import sys, time
    from grpo_trainer.runtime.run_lock import acquire
    assert acquire(sys.argv[1]) is None
    print("LOCKED", flush=True)
    time.sleep(600)
''')


TRAINING = textwrap.dedent('''
    import sys
    from transformers import TrainerCallback
    from grpo_trainer.cli.toy import copy_digits_dataset, make_tokenizer
    from tests.helpers import make_trainer

    class Announce(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                print("TRAINING", flush=True)

    # It only has to hold the lock: trains until killed, a checkpoint every step.
    make_trainer(sys.argv[1], make_tokenizer(), copy_digits_dataset(64), max_completion_length=4, max_steps=100000,
                 save_strategy="steps", save_steps=1, callbacks=[Announce()]).train()
''')


def start(tmp_path, source, ready):
    script = tmp_path / "other.py"
    script.write_text(source)
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    for line in process.stdout:  # the Trainer prints its logs there too
        if line.strip() == ready:
            return process
    raise AssertionError(f"the other run ended before it was {ready}: exit code {process.wait()}")


def live(tmp_path, source, ready):
    process = start(tmp_path, source, ready)
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def other_training_run(tmp_path):
    """A real training run into tmp_path / 'out', saving a checkpoint every step."""
    yield from live(tmp_path, TRAINING, "TRAINING")


@pytest.fixture
def other_run(tmp_path):
    """Another live process holding the lock of tmp_path / 'out', as a training run does (quicker to start)."""
    yield from live(tmp_path, HOLDER, "LOCKED")


def write_lock(folder, **owner):
    folder.mkdir(exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(owner))


def test_a_second_run_is_refused_while_the_first_lives(tmp_path, other_training_run, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path / "out", tokenizer, toy_dataset, max_steps=1, save_strategy="steps", save_steps=1)
    with pytest.raises(OutputDirInUseError) as error:
        trainer.train()
    message = str(error.value)
    assert f"output_dir {tmp_path / 'out'} is in use by another run (pid {other_training_run.pid} on" in message
    assert "ignore_output_dir_lock=True" in message and trainer.state.global_step == 0
    assert json.loads((tmp_path / "out" / LOCK_NAME).read_text())["pid"] == other_training_run.pid  # still theirs


def test_the_opt_in_writes_into_a_folder_in_use(tmp_path, other_run, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path / "out", tokenizer, toy_dataset, max_steps=1, ignore_output_dir_lock=True)
    with pytest.warns(UserWarning, match="writing to it anyway \\(ignore_output_dir_lock=True\\)"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert json.loads((tmp_path / "out" / LOCK_NAME).read_text())["pid"] == other_run.pid


def test_the_lock_of_a_run_that_ended_is_taken_over(tmp_path, other_run, tokenizer, toy_dataset):
    other_run.kill()
    other_run.wait()
    trainer = make_trainer(tmp_path / "out", tokenizer, toy_dataset, max_steps=1)
    with pytest.warns(UserWarning, match=f"taking over the stale lock .* \\(pid {other_run.pid} has exited\\)"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # released when train() returned


def test_the_lock_is_released_when_training_fails(tmp_path, tokenizer, toy_dataset):
    def broken(completions, **kwargs):
        raise RuntimeError("bug")

    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, reward_funcs=broken, max_steps=1)
    with pytest.raises(Exception, match="bug"):
        trainer.train()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_file_names_this_process_and_the_same_process_may_take_it_again(tmp_path):
    assert acquire(str(tmp_path)) is None
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    assert acquire(str(tmp_path)) is None  # a second trainer in the same script
    release(str(tmp_path))
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("content", ["{\"pid\": 12", "not json", "{}"])
def test_an_unreadable_lock_is_stale(tmp_path, content):
    (tmp_path / LOCK_NAME).write_text(content)
    with pytest.warns(UserWarning, match="taking over the stale lock .* \\(unreadable\\)"):
        assert acquire(str(tmp_path)) is None
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


@pytest.mark.skipif(_start_time(os.getppid()) is None, reason="process start times come from Linux's /proc")
def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path):
    parent, host = os.getppid(), socket.gethostname()  # a live process that is not this one
    write_lock(tmp_path, pid=parent, host=host, start=_start_time(parent))
    assert "is in use by another run" in acquire(str(tmp_path))
    write_lock(tmp_path, pid=parent, host=host, start="1")  # the lock's process started at another time
    with pytest.warns(UserWarning, match=f"taking over the stale lock .* \\(pid {parent} has exited\\)"):
        assert acquire(str(tmp_path)) is None


def test_a_lock_from_another_host_is_refused_with_the_file_to_delete(tmp_path):
    write_lock(tmp_path, pid=os.getpid(), host="some-other-node", start=None, since="2026-01-01 00:00:00")
    refusal = acquire(str(tmp_path))
    assert "(pid " in refusal and "on some-other-node" in refusal
    assert "if that run is over, delete the lock file" in refusal and str(tmp_path / LOCK_NAME) in refusal
