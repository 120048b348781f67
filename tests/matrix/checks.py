"""What every cell of the combination matrix must show (`check_trained`, `check_refused`), the launch of a process
layout's cells (`launch`) and running it once per session (`once_per_session`): shared by
tests/matrix/test_matrix.py and the vLLM stage's tests/vllm_integration/test_matrix_vllm.py."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.matrix import cell_run, factors

# One launch per process layout. The sp_size=2 rows run in the DDP launch: accelerate_configs/cpu/ddp_sp.yaml is
# ddp.yaml, the group being set in the training config (`cell_run.settings_of`).
LAUNCHES = {"ddp": ("ddp.yaml", {"ACCELERATE_USE_CPU": "true"}), "zero2": ("deepspeed_zero2.yaml", {}),
            "zero3": ("deepspeed_zero3.yaml", {}), "fsdp2": ("fsdp2.yaml", {"ACCELERATE_USE_CPU": "true"})}
TWIN_TOLERANCE = 1e-5  # packed and padded log-probs agree to float32 rounding (modeling/forwards.py)


def launch(layout: str, cells: list[dict], out: Path, vllm: dict | None = None) -> list[dict] | str:
    """`cells` in one `accelerate launch` of cell_run.py with `layout`'s config; their records, or what went wrong."""
    from tests.distributed.conftest import accelerate_launch, launch_env

    config, env = LAUNCHES[layout]
    if "deepspeed" in config and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install '.[deepspeed]')")
    (out / "cells.json").write_text(json.dumps(cells))
    extra = ["--vllm", json.dumps(vllm)] if vllm else []
    code, wall = accelerate_launch(config, ["--cells", str(out / "cells.json"), "--out", str(out), *extra],
                                   launch_env(env), out / "launch.log", script=Path(cell_run.__file__))
    if code != 0 or not (out / "results.json").exists():
        tail = "\n".join((out / "launch.log").read_text(errors="replace").splitlines()[-60:])
        return f"matrix {layout}: accelerate launch exited {code} after {wall:.0f}s; its last lines:\n{tail}"
    return json.loads((out / "results.json").read_text())


def once_per_session(tmp_path_factory, name: str, run: Callable[[Path], Any]) -> Any:
    """`run(folder)`'s result (JSON), computed once per test session. Under pytest-xdist every worker whose tests
    need it would run it (a launch per worker: tests/matrix took 203 s at -n 2, 63-107 s with this, 2026-12-01); its
    workers share the session's base folder, so the first to get here runs it under a lock while the others wait,
    then read its result."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return run(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # the session's, above each worker's own
    result = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not result.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(run(folder), default=str))
    return json.loads(result.read_text())


def check_trained(row: dict, record: dict) -> None:
    """What every trained cell must show (shared with the vLLM stage's cells)."""
    assert "error" not in record, f"{record['error']}\n{record.get('traceback', '')}"
    processes = 1 if row["processes"] == "1" else 2
    assert record["processes"] == processes and record["steps"] == cell_run.STEPS
    assert len(record["losses"]) == cell_run.STEPS and all(math.isfinite(x) for x in record["losses"])
    assert record["moved"], "no trainable parameter changed in 2 SGD steps at learning rate 0.1"
    assert len(record["digests"]) == processes and len(set(record["digests"])) == 1, record["digests"]
    launch = factors.launch_of(row)  # what the refusal tables were read with
    assert record["launch"] == {k: getattr(launch, k) for k in cell_run.LAUNCH_FACTS}, record["launch"]
    assert record["sp_size"] == int(row["sp_size"])
    # replay runs on the MoE model where asked; the dense model's 'auto' is off (MoE rows are in-process: UNBUILT)
    assert record["routing_replay"] == (row["routing_replay"] == "on")
    if row["resume"] == "save":
        assert record["resumed_steps"] == cell_run.STEPS
        assert record["resume_diff"] == 0.0, "the run resumed from checkpoint-1 differs from the straight run"
    if row["padding_free"] == "on":
        assert record["twin_diff"] <= TWIN_TOLERANCE, f"packed vs padded twin: {record['twin_diff']}"
        # packing is refused by rule (modeling.forwards.REFUSALS) for a vision-language model and where the LM head
        # runs inside a sharded forward (ZeRO-3, FSDP2): those runs are padded, and must still equal their twin
        # ('skip' leaves one group of one prompt per process, whose rows packing cannot shorten: it runs padded)
        packs = row["prompts"] == "text" and row["processes"] not in factors.SHARDED
        if row["zero_variance_groups"] != "skip":  # on any process: each weighs its own micro-batches
            assert (sum(record["packed_forwards"]) > 0) == packs, f"packed forwards: {record['packed_forwards']}"
    else:
        assert sum(record["packed_forwards"]) == 0
    if row["async_rollouts"] != "0":
        assert record["staleness"], "an async run logged no async/staleness_max"
        assert max(record["staleness"]) <= int(row["async_rollouts"])
    if row["zero_variance_groups"] == "train" and row["async_rollouts"] == "0":
        # the reward saturates one group per process and call (cell_run records rounds the synchronous path builds)
        assert record["uninformative_groups"] > 0
    if row["zero_variance_groups"] == "resample":
        assert record["extra_rounds"] > 0, "the reward saturates some groups, yet resampling drew no extra round"
        assert record["uninformative_groups"] == 0, "a kept round holds a group whose advantages are all 0"


def check_refused(row: dict, record: dict) -> None:
    """The error is the package's own refusal for the row (`factors.refusal`: its table's message on the row's
    settings), raised before the model loads."""
    refused = factors.refusal(row)
    assert record["error"] is not None, f"{factors.name(row)} was not refused ({refused.table}: {refused.name})"
    kind, message = record["error"]
    assert kind == "ValueError", f"{kind}: {message} (an OSError means the model was read before the refusal)"
    assert " ".join(refused.message.split()) in message, f"expected {refused.table} {refused.name!r}: {message}"
    assert record["where"] == refused.where, f"raised by the {record['where']}, expected by the {refused.where}"
