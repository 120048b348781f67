"""Checkpoints are verified before a run resumes from them and written completely or not at all: corrupt or cut-off
checkpoints are skipped (or refused by path, naming the file), a failed save says what happened and leaves every
earlier checkpoint intact, and a run resumed at max_steps trains nothing more."""

import errno
import json
import os
import shutil
import subprocess
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from grpo_trainer.runtime import checkpoints
from grpo_trainer.runtime.checkpoints import (
    IN_PROGRESS,
    MANIFEST,
    CheckpointSaveError,
    CorruptCheckpointError,
    latest_complete,
    problem,
    save_guard,
    write_manifest,
)
from tests.helpers import make_trainer


def make_checkpoint(folder, manifest=True):
    """A small checkpoint-shaped folder: safetensors weights, a torch zip archive, trainer_state.json."""
    folder.mkdir(parents=True)
    save_file({"weight": torch.arange(64.0)}, str(folder / "model.safetensors"))
    torch.save({"state": torch.ones(256)}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    if manifest:
        write_manifest(str(folder))
    return folder


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _no_barrier():
    pass


# ------------------------------------------------------------------------------------------ verification


def test_manifest_records_every_file_and_an_intact_checkpoint_passes(tmp_path):
    folder = make_checkpoint(tmp_path / "checkpoint-2")
    files = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(files) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert files["optimizer.pt"]["size"] == os.path.getsize(folder / "optimizer.pt")
    assert problem(str(folder)) is None


# model.safetensors: an 8-byte length, a 64-byte JSON header, 64 float32 values = 328 bytes; truncated to half.
@pytest.mark.parametrize("damage, reason", [
    (lambda f: truncate(f / "model.safetensors"), "model.safetensors has 164 bytes, the manifest says 328"),
    (lambda f: flip_byte(f / "optimizer.pt", -100), "optimizer.pt does not match its checksum"),
    (lambda f: os.remove(f / "trainer_state.json"), "trainer_state.json is missing"),
])
def test_manifest_catches_truncated_corrupt_and_missing_files(tmp_path, damage, reason):
    folder = make_checkpoint(tmp_path / "checkpoint-2")
    damage(folder)
    assert reason in problem(str(folder))


@pytest.mark.parametrize("damage, reason", [
    (lambda f: None, None),
    (lambda f: truncate(f / "model.safetensors"), "model.safetensors is truncated"),
    (lambda f: truncate(f / "optimizer.pt"), "optimizer.pt is truncated (no zip central directory)"),
    # The tensor's bytes sit in the middle of the archive: the zip's own CRC-32 catches a flipped byte there.
    (lambda f: flip_byte(f / "optimizer.pt", os.path.getsize(f / "optimizer.pt") // 2), "fails its CRC check"),
    (lambda f: os.remove(f / "trainer_state.json"), "trainer_state.json is missing"),
    (lambda f: (f / "trainer_state.json").write_text('{"global_step": 2, "lo'), "trainer_state.json is not valid"),
])
def test_checkpoint_from_before_manifests_is_checked_by_its_structure(tmp_path, damage, reason):
    folder = make_checkpoint(tmp_path / "checkpoint-2", manifest=False)
    damage(folder)
    found = problem(str(folder))
    assert found is None if reason is None else reason in found


def test_a_save_that_never_finished_is_not_complete_even_if_its_files_look_whole(tmp_path):
    folder = make_checkpoint(tmp_path / "checkpoint-2", manifest=False)
    (folder / IN_PROGRESS).touch()
    assert problem(str(folder)) == "its save never finished (no manifest)"


def test_latest_complete_skips_each_newer_broken_checkpoint_with_a_warning(tmp_path):
    make_checkpoint(tmp_path / "checkpoint-2")
    truncate(make_checkpoint(tmp_path / "checkpoint-4") / "optimizer.pt")
    (make_checkpoint(tmp_path / "checkpoint-10", manifest=False) / IN_PROGRESS).touch()
    with pytest.warns(UserWarning) as caught:
        assert latest_complete(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    messages = [str(w.message) for w in caught]
    assert "checkpoint-10: its save never finished" in messages[0]
    assert "checkpoint-4: optimizer.pt has" in messages[1]


# ------------------------------------------------------------------------------------------------- saving


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "no space left on device"),
                                          (errno.EACCES, "permission denied"),
                                          (errno.EDQUOT, "disk quota exceeded")])
def test_a_failed_save_removes_its_folder_and_says_what_happened(tmp_path, code, reason):
    make_checkpoint(tmp_path / "checkpoint-2")
    folder = tmp_path / "checkpoint-4"
    with pytest.raises(CheckpointSaveError) as error:
        with save_guard(str(folder), True, _no_barrier):
            (folder / "model.safetensors").write_bytes(b"half")
            raise OSError(code, os.strerror(code), str(folder / "optimizer.pt"))
    message = str(error.value)
    assert message.startswith(f"{reason} while writing {folder / 'optimizer.pt'}")
    assert f"{tmp_path / 'checkpoint-2'} is the newest complete checkpoint" in message
    assert not folder.exists() and problem(str(tmp_path / "checkpoint-2")) is None


def test_saving_a_step_again_keeps_the_old_checkpoint_until_the_new_one_is_complete(tmp_path):
    folder = make_checkpoint(tmp_path / "checkpoint-2")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(CheckpointSaveError, match="the complete .*checkpoint-2 it was replacing put back"):
        with save_guard(str(folder), True, _no_barrier):
            assert not (folder / "optimizer.pt").exists()  # the old one is aside, not overwritten in place
            (folder / "optimizer.pt").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    with save_guard(str(folder), True, _no_barrier):  # a save that succeeds replaces it
        torch.save({"state": torch.zeros(4)}, folder / "optimizer.pt")
        (folder / "trainer_state.json").write_text("{}")
    assert problem(str(folder)) is None and sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert (folder / "optimizer.pt").read_bytes() != before["optimizer.pt"]


# -------------------------------------------------------------------------------------- through the trainer


class StepRecorder(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def train(output_dir, tokenizer, dataset, resume=None, **overrides):
    """Train (4 steps, a checkpoint every 2 unless overridden); the trainer records the steps this call ran."""
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2)
    trainer = make_trainer(output_dir, tokenizer, dataset, **{**settings, **overrides})
    trainer.steps_run = StepRecorder()
    trainer.add_callback(trainer.steps_run)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("broken", ["model.safetensors", "optimizer.pt"])
def test_resume_skips_a_corrupt_newest_checkpoint_and_refuses_it_by_path(tmp_path, tokenizer, toy_dataset, broken):
    train(tmp_path, tokenizer, toy_dataset)
    truncate(tmp_path / "checkpoint-4" / broken)
    with pytest.raises(CorruptCheckpointError) as error:
        train(tmp_path, tokenizer, toy_dataset, resume=str(tmp_path / "checkpoint-4"), max_steps=6)
    assert f"cannot resume from {tmp_path / 'checkpoint-4'}: {broken} has" in str(error.value)
    assert f"{tmp_path / 'checkpoint-2'} is complete" in str(error.value)
    with pytest.warns(UserWarning, match=f"skipping {tmp_path / 'checkpoint-4'}: {broken} has"):
        trainer = train(tmp_path, tokenizer, toy_dataset, resume=True, max_steps=6)
    assert trainer.steps_run.steps == [3, 4, 5, 6]  # resumed after step 2
    assert latest_complete(str(tmp_path)) == str(tmp_path / "checkpoint-6")


def test_checkpoint_written_before_manifests_still_resumes(tmp_path, tokenizer, toy_dataset):
    train(tmp_path, tokenizer, toy_dataset, max_steps=2)
    os.remove(tmp_path / "checkpoint-2" / MANIFEST)
    trainer = train(tmp_path, tokenizer, toy_dataset, resume=True, max_steps=3)
    assert trainer.steps_run.steps == [3]


def test_resume_at_or_past_max_steps_trains_nothing(tmp_path, tokenizer, toy_dataset):
    train(tmp_path, tokenizer, toy_dataset)
    saved = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    for max_steps in (4, 3):
        trainer = train(tmp_path, tokenizer, toy_dataset, resume=True, max_steps=max_steps)
        assert trainer.state.global_step == 4 and trainer.steps_run.steps == []
        current = {n: p.detach() for n, p in trainer.model.named_parameters()}
        assert all(torch.equal(current[n], saved[n]) for n in saved)


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "no space left on device"),
                                          (errno.EACCES, "permission denied")])
def test_a_failing_writer_raises_what_happened_and_keeps_earlier_checkpoints(tmp_path, tokenizer, toy_dataset, code,
                                                                             reason):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, max_steps=4, save_strategy="steps", save_steps=2,
                           save_total_limit=1)
    real = trainer._save_optimizer_and_scheduler

    def fails_the_second_time(output_dir):
        if output_dir.endswith("checkpoint-4"):
            (open(os.path.join(output_dir, "optimizer.pt"), "wb")).close()
            raise OSError(code, os.strerror(code), os.path.join(output_dir, "optimizer.pt"))
        real(output_dir)

    with mock.patch.object(trainer, "_save_optimizer_and_scheduler", side_effect=fails_the_second_time), \
            pytest.raises(CheckpointSaveError) as error:
        trainer.train()
    assert str(error.value).startswith(f"{reason} while writing {tmp_path / 'checkpoint-4' / 'optimizer.pt'}")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert problem(str(tmp_path / "checkpoint-2")) is None


def test_older_checkpoints_are_rotated_out_only_once_the_new_one_is_complete(tmp_path, tokenizer, toy_dataset):
    # save_total_limit=1: rotation would delete checkpoint-2 as soon as checkpoint-4's files are written. The
    # manifest, the last write, fails here: checkpoint-2 must survive.
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, max_steps=4, save_strategy="steps", save_steps=2,
                           save_total_limit=1)
    real = checkpoints.write_manifest

    def fails_on_checkpoint_4(folder):
        if folder.endswith("checkpoint-4"):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, MANIFEST))
        real(folder)

    with mock.patch.object(checkpoints, "write_manifest", side_effect=fails_on_checkpoint_4), \
            pytest.raises(CheckpointSaveError, match="no space left on device"):
        trainer.train()
    assert latest_complete(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


# -------------------------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1.6 MB tmpfs: room for one checkpoint of the tiny model (about 1.1 MB), not two. Needs root."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_disk_full_during_a_save(small_disk, tokenizer, toy_dataset):
    trainer = make_trainer(small_disk, tokenizer, toy_dataset, max_steps=4, save_strategy="steps", save_steps=2)
    with pytest.raises(CheckpointSaveError) as error:
        trainer.train()
    message = str(error.value)
    assert message.startswith(f"no space left on device while writing {small_disk / 'checkpoint-4'}")
    assert f"The partial checkpoint {small_disk / 'checkpoint-4'} was removed" in message
    assert "Free some space" in message
    assert sorted(p.name for p in small_disk.glob("checkpoint-*")) == ["checkpoint-2"]
    assert problem(str(small_disk / "checkpoint-2")) is None
    resumed = make_trainer(small_disk, tokenizer, toy_dataset, max_steps=3)  # the space came back
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_a_stateless_optimizer_checkpoint_is_restored_by_its_groups_hyperparameters(tmp_path):
    """`load_param_groups_only` (the FSDP2 resume of an optimizer without per-parameter state): the saved SGD's
    groups carry lr 0.05 and momentum 0, the new optimizer's lr 0.1 becomes 0.05 (its params untouched); a
    checkpoint with state tensors (Adam's exp_avg) is left to the Trainer (False, nothing changed)."""
    weight = torch.nn.Parameter(torch.ones(2))
    torch.save({"state": {}, "param_groups": [{"lr": 0.05, "momentum": 0, "initial_lr": 0.1,
                                               "params": ["model.weight"]}]}, tmp_path / "optimizer.bin")
    sgd = torch.optim.SGD([weight], lr=0.1)
    assert checkpoints.load_param_groups_only(sgd, str(tmp_path))
    assert sgd.param_groups[0]["lr"] == 0.05 and sgd.param_groups[0]["initial_lr"] == 0.1
    assert sgd.param_groups[0]["params"] == [weight]

    torch.save({"state": {"model.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)}},
                "param_groups": [{"lr": 0.05, "params": ["model.weight"]}]}, tmp_path / "optimizer.bin")
    adam = torch.optim.Adam([weight], lr=0.1)
    assert not checkpoints.load_param_groups_only(adam, str(tmp_path))
    assert adam.param_groups[0]["lr"] == 0.1
    assert not checkpoints.load_param_groups_only(sgd, str(tmp_path / "missing"))  # no optimizer.bin: Trainer's


def test_a_stateless_optimizer_checkpoint_with_other_groups_is_refused_by_name(tmp_path):
    torch.save({"state": {}, "param_groups": [{"lr": 0.05, "params": []}, {"lr": 0.05, "params": []}]},
               tmp_path / "optimizer.bin")
    with pytest.raises(ValueError, match="2 parameter groups, this run's has 1"):
        checkpoints.load_param_groups_only(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                                           str(tmp_path))
