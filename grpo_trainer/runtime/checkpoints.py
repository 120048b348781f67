"""Checkpoints that can be trusted: written completely or not at all, verified before a run resumes from them.

Decisions:

1. A checkpoint is complete when its manifest (`checkpoint_manifest.json`: every file's size and CRC-32) is there
   and every file matches it. The manifest is written last, after every process has finished writing, under a
   temporary name and then renamed (atomic on POSIX). CRC-32 is the checksum zip archives (and so `torch.save`)
   use: it catches truncation and accidental corruption, not tampering, and hashes several GB/s.
2. While a save runs its folder holds a marker (`.save_in_progress`); a folder with the marker and no manifest was
   cut off and is never resumed from.
3. Checkpoints without manifest or marker were written before manifests existed. They are checked by their
   structure: `trainer_state.json` (which `Trainer` writes after the weights, optimizer, scheduler and RNG
   states) and every other JSON file parse, every safetensors file's header parses and its tensors cover the file
   exactly, every zip archive (`.pt`, `.pth`, `.bin` written by `torch.save`) passes its own CRC-32 check.
4. `resume_from_checkpoint=True` takes the newest checkpoint that passes, with a warning naming each newer one
   skipped and why; an explicit path that fails raises `CorruptCheckpointError` naming the file.
5. A save that fails (disk full, permissions, ...) removes its partial folder and raises `CheckpointSaveError`
   saying what happened and to which file. A folder saved again at the same step is first moved aside and only
   deleted once the new one is complete (restored if the new save fails): nothing already saved is lost.
6. Resuming restores every weight. `save_pretrained` writes some models' weights under other names than the
   model's own (vision-language models: `model.language_model.*` is saved as `model.*`), and `Trainer` reloads a
   checkpoint's names as they are, with a warning, leaving those weights at their initial values. Such a
   checkpoint is read back with `from_pretrained`, which maps the names, and copied into the model
   (`load_renamed_weights`).
7. An FSDP2 optimizer saved as one full state (`optimizer.bin`, FULL_STATE_DICT) that holds no per-parameter
   tensor (SGD without momentum keeps none: its state is `{}`) is restored by its groups' hyperparameters
   (`load_param_groups_only`). torch 2.13's `set_optimizer_state_dict`, which transformers' resume calls through
   accelerate's `load_fsdp_optimizer`, raises "Expected device to be set" for such an optimizer on every
   transformers release (it takes the device from the optimizer's own state tensors, and there are none); the
   hyperparameters (the scheduled `lr` among them) are all such a checkpoint holds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers import PreTrainedModel

__all__ = ["CheckpointSaveError", "CorruptCheckpointError", "check_resumable", "is_saved", "latest_complete",
           "load_param_groups_only", "load_renamed_weights", "problem", "resolve_resume", "save_guard",
           "write_manifest"]

MANIFEST = "checkpoint_manifest.json"
IN_PROGRESS = ".save_in_progress"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
_CHUNK = 8 << 20


class CorruptCheckpointError(ValueError):
    """A checkpoint asked for by path is incomplete or corrupt; the message names the file."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; its partial folder was removed and earlier checkpoints are untouched."""


# ----------------------------------------------------------------------------------------------- manifest


def _files(folder: str) -> list[str]:
    """Every regular file under `folder`, as sorted paths relative to it (the manifest and marker excluded)."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative not in (MANIFEST, IN_PROGRESS) and not name.startswith(MANIFEST):
                found.append(relative)
    return sorted(found)


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL: files are hashed in parallel threads
    return f"{crc:08x}"


def _checksums(folder: str, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(min(8, max(1, len(names)))) as pool:
        return list(pool.map(lambda name: _crc32(os.path.join(folder, name)), names))


def _fsync_directory(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def write_manifest(folder: str) -> None:
    """Record every file's size and CRC-32, atomically: the manifest either exists whole or not at all."""
    names = _files(folder)
    files = {name: {"size": os.path.getsize(os.path.join(folder, name)), "crc32": crc}
             for name, crc in zip(names, _checksums(folder, names))}
    temporary = os.path.join(folder, f"{MANIFEST}.tmp-{os.getpid()}")
    with open(temporary, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, MANIFEST))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, IN_PROGRESS))
    _fsync_directory(folder)


# ------------------------------------------------------------------------------------------- verification


def _against_manifest(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for name, expected in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if (size := os.path.getsize(path)) != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
    names = list(files)
    for name, crc in zip(names, _checksums(folder, names)):
        if crc != files[name]["crc32"]:
            return f"{name} does not match its checksum in {MANIFEST} (corrupt)"
    return None


def _safetensors_problem(path: str) -> str | None:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return "is shorter than a safetensors header"
        (header_size,) = struct.unpack("<Q", prefix)
        size = os.path.getsize(path)
        if header_size > size - 8:
            return f"is truncated (header of {header_size} bytes in a file of {size})"
        try:
            header = json.loads(f.read(header_size))
        except ValueError:
            return "has an unreadable header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_size + end != size:
        return f"is truncated ({size} bytes; its header describes {8 + header_size + end})"
    return None


def _zip_problem(path: str) -> str | None:
    if os.path.getsize(path) == 0:
        return "is empty"
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:  # torch's legacy (pre-zip) format cannot be checked; a zip cut short can
            return "is truncated (no zip central directory)" if f.read(4) == b"PK\x03\x04" else None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"is corrupt ({exc})"
    return f"is corrupt (member {bad!r} fails its CRC check)" if bad else None


def _structure_problem(folder: str) -> str | None:
    """Decision 3: the checks for a checkpoint written without a manifest."""
    if not os.path.isfile(os.path.join(folder, "trainer_state.json")):
        return "trainer_state.json is missing (the save was cut off)"
    for name in _files(folder):
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            try:
                with open(path) as f:
                    json.load(f)
            except (OSError, ValueError):
                return f"{name} is not valid JSON (cut off mid-write?)"
        found = _safetensors_problem(path) if name.endswith(".safetensors") else \
            _zip_problem(path) if name.endswith(_ZIP_SUFFIXES) else None
        if found:
            return f"{name} {found}"
    return None


def problem(folder: str) -> str | None:
    """Why the checkpoint in `folder` cannot be resumed from, or None when it is complete (decisions 1-3)."""
    if not os.path.isdir(folder):
        return "it is not a directory"
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        return _against_manifest(folder)
    if os.path.exists(os.path.join(folder, IN_PROGRESS)):
        return "its save never finished (no manifest)"
    return _structure_problem(folder)


def _by_step(output_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(output_dir):
        return []
    return sorted(((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))),
                  reverse=True)


def latest_complete(output_dir: str) -> str | None:
    """The newest checkpoint under `output_dir` that passes `problem`, warning about each newer one skipped."""
    for _, name in _by_step(output_dir):
        path = os.path.join(output_dir, name)
        if (reason := problem(path)) is None:
            return path
        warnings.warn(f"skipping {path}: {reason}; resuming from an earlier checkpoint.", stacklevel=2)
    return None


def check_resumable(path: str) -> None:
    """Raise `CorruptCheckpointError` naming the file when the checkpoint at `path` cannot be resumed from."""
    if (reason := problem(path)) is not None:
        earlier = latest_complete(os.path.dirname(os.path.abspath(path)))
        hint = f"; {earlier} is complete" if earlier else ""
        raise CorruptCheckpointError(f"cannot resume from {path}: {reason}{hint}. Pass a complete checkpoint, or "
                                     "resume_from_checkpoint=True to take the newest complete one.")


def resolve_resume(resume: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint that `train(resume_from_checkpoint=resume)` loads: None for a fresh start, the newest complete
    one under `output_dir` for True, `resume` itself once it verifies for a path."""
    if resume is True:
        found = latest_complete(output_dir)
        if found is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint; pass a "
                             "checkpoint path, or start without resume_from_checkpoint.")
        return found
    if isinstance(resume, str):
        check_resumable(resume)
        return resume
    return None


def is_saved(output_dir: str, step: int) -> bool:
    """Whether `output_dir` already holds a complete checkpoint of `step`."""
    return problem(os.path.join(output_dir, f"checkpoint-{step}")) is None


# ------------------------------------------------------------------------------------------------ saving

_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
            errno.EROFS: "read-only file system"}
_MIN_FREE = 1 << 20  # less than this left after a failed write: the disk is full whatever the error said


def _errno(exc: BaseException) -> int | None:
    """The OS error behind `exc`: from an OSError in its chain, or from a message such as safetensors' Rust
    '(os error 28)'; torch's zip writer reports a full disk only as 'unexpected pos'."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        if match := re.search(r"os error (\d+)", str(seen)):
            return int(match.group(1))
        for code, text in _REASONS.items():
            if text in str(seen).lower():
                return code
        seen = seen.__cause__ or seen.__context__
    return None


def _newest_file(folder: str) -> str | None:
    paths = [os.path.join(folder, name) for name in _files(folder)] if os.path.isdir(folder) else []
    return max(paths, key=os.path.getmtime, default=None)


def _free_bytes(path: str) -> int | None:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        stats = os.statvfs(path or ".")
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def save_failure(folder: str, exc: BaseException, remove: bool = True, restore: str | None = None
                 ) -> CheckpointSaveError:
    """Describe what went wrong (the OS reason, the file, what to do) and, with `remove`, delete the partial
    `folder`, putting back the complete one it replaced (`restore`) if any."""
    code, free = _errno(exc), _free_bytes(folder)
    if code is None and free is not None and free < _MIN_FREE:
        code = errno.ENOSPC
    filename = getattr(exc, "filename", None) or _newest_file(folder) or folder
    reason = _REASONS.get(code) or (os.strerror(code).lower() if code else f"{type(exc).__name__}: {exc}")
    done = "The partial checkpoint was not removed (another process writes it); "
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
        done = f"The partial checkpoint {folder} was removed; "
        if restore and os.path.isdir(restore):
            os.replace(restore, folder)
            done = f"The partial save was removed and the complete {folder} it was replacing put back; "
    earlier = latest_complete(os.path.dirname(folder))
    space = f" ({free} bytes free)" if code in (errno.ENOSPC, errno.EDQUOT) and free is not None else ""
    fix = {errno.ENOSPC: "Free some space, set save_total_limit, or point output_dir at a larger disk",
           errno.EDQUOT: "Free some space or raise the quota",
           errno.EACCES: "Make output_dir writable", errno.EPERM: "Make output_dir writable",
           errno.EROFS: "Point output_dir at a writable file system"}.get(code, "Fix the cause")
    newest = f"{earlier} is the newest complete checkpoint" if earlier else "no earlier checkpoint exists"
    return CheckpointSaveError(f"{reason} while writing {filename}{space}. {done}{newest}. {fix}, then resume "
                               "with resume_from_checkpoint=True.")


@contextlib.contextmanager
def save_guard(folder: str, writes: bool, wait_for_everyone: Callable[[], None]) -> Iterator[None]:
    """Around one checkpoint save into `folder`: the in-progress marker, the old folder kept aside until the new
    one is complete, the manifest once every process has written, and a clear error (partial folder removed) if
    the save fails. `writes`: this process writes the marker and manifest (the main process, or each node's)."""
    aside = os.path.join(os.path.dirname(folder), f"_replaced-{os.path.basename(folder)}")
    if writes:
        if os.path.isdir(folder):
            if problem(folder) is None:
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(folder, aside)
            else:
                shutil.rmtree(folder)
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, IN_PROGRESS), "w").close()
    wait_for_everyone()  # no process writes into the folder before it is set up
    try:
        yield
        wait_for_everyone()
        if writes:
            write_manifest(folder)
    except Exception as exc:
        raise save_failure(folder, exc, remove=writes, restore=aside) from exc
    if writes:
        shutil.rmtree(aside, ignore_errors=True)


def load_renamed_weights(model: nn.Module, checkpoint: str) -> bool:
    """Load a checkpoint's full weights into `model` when they are saved under other names than the model's own
    (decision 3); False (nothing loaded) for any other model or checkpoint, which `Trainer` loads itself."""
    path = os.path.join(checkpoint, "model.safetensors")
    if not isinstance(model, PreTrainedModel) or not os.path.isfile(path):
        return False
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        saved = set(f.keys())
    if saved <= set(model.state_dict()):
        return False
    dtype = next(model.parameters()).dtype
    reloaded = type(model).from_pretrained(checkpoint, dtype=dtype, device_map="cpu")
    missing, unexpected = model.load_state_dict(reloaded.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"the checkpoint {checkpoint} does not hold this model's weights (missing: "
                           f"{missing[:5]}, unexpected: {unexpected[:5]}).")
    del reloaded
    with torch.no_grad():
        model.tie_weights()
    return True


def load_param_groups_only(optimizer: torch.optim.Optimizer, checkpoint: str) -> bool:
    """Restore a full-state FSDP2 optimizer checkpoint that holds no per-parameter tensor into `optimizer` by its
    groups' hyperparameters (decision 7); False (nothing loaded) for any other checkpoint, which `Trainer` loads
    itself. Every process reads the file (it is small: no tensors), so all take the same branch."""
    path = os.path.join(checkpoint, "optimizer.bin")  # accelerate's FULL_STATE_DICT name for optimizer 0
    if not os.path.isfile(path):
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if any(isinstance(value, torch.Tensor) and value.dim() > 0 for state in saved["state"].values()
           for value in state.values()):
        return False
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer in {checkpoint} has {len(saved['param_groups'])} parameter groups, this "
                         f"run's has {len(optimizer.param_groups)}: resume with the optimizer settings it was saved "
                         "with.")
    for group, stored in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in stored.items() if key != "params"})
    return True
