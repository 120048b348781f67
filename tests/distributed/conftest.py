"""Launch each distributed mode once per test session and hand its recorded result to every test that asks.

Each launch is `accelerate launch --config_file accelerate_configs/cpu/<mode>.yaml tests/distributed/harness.py`
with 2 processes over gloo, under a timeout; on a hang the whole process group is killed. The 1-process
reference runs in this pytest process (no start-up cost), with the same harness.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("harness.py")
LAUNCH_TIMEOUT_S = 300
sys.path.insert(0, str(HARNESS.parent))

import harness  # noqa: E402 - found through the sys.path entry above

from tests.helpers import run_bounded  # noqa: E402


@dataclass(frozen=True)
class Mode:
    config: str  # file in accelerate_configs/cpu/
    distributed_type: str  # what accelerate must report
    wrapper: str  # a class name in the MRO of trainer.model_wrapped
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    lora: bool = False


CPU = {"ACCELERATE_USE_CPU": "true"}
MODES = {
    "ddp": Mode("ddp.yaml", "MULTI_CPU", "DistributedDataParallel", env=CPU),
    "zero2": Mode("deepspeed_zero2.yaml", "DEEPSPEED", "DeepSpeedEngine", ("--ddp-backend", "gloo")),
    # Sharded generation (no gather): the processes must step together while their completions differ in length.
    "zero3": Mode("deepspeed_zero3.yaml", "DEEPSPEED", "DeepSpeedEngine",
                  ("--ddp-backend", "gloo", "--no-ds3-gather")),
    # LM-head chunks of 3 rows: processes whose completions differ in length score different numbers of chunks
    # (at a 152k vocabulary a chunk is 220 rows); a partitioned head gathered per chunk would leave them waiting on
    # each other, so under ZeRO-3 the head runs inside the forward (`modeling.logprobs.head_runs_inside_forward`).
    "zero3_chunked": Mode("deepspeed_zero3.yaml", "DEEPSPEED", "DeepSpeedEngine",
                          ("--ddp-backend", "gloo", "--no-ds3-gather", "--logprob-chunk-size", "3")),
    "fsdp2": Mode("fsdp2.yaml", "FSDP", "FSDPModule", env=CPU),
    "lora_ddp": Mode("ddp.yaml", "MULTI_CPU", "DistributedDataParallel", ("--lora",), env=CPU, lora=True),
    # padding_free: packed log-prob forwards (the 1-process reference runs padded).
    # Sequence parallelism: each process scores half of the positions of each process's rows in turn (ALST's loop).
    "ddp_sp": Mode("ddp_sp.yaml", "MULTI_CPU", "DistributedDataParallel", ("--sequence-parallel",), env=CPU),
    "ddp_packed": Mode("ddp.yaml", "MULTI_CPU", "DistributedDataParallel", ("--padding-free",), env=CPU),
    "zero2_packed": Mode("deepspeed_zero2.yaml", "DEEPSPEED", "DeepSpeedEngine",
                         ("--ddp-backend", "gloo", "--padding-free")),
    "zero3_packed": Mode("deepspeed_zero3.yaml", "DEEPSPEED", "DeepSpeedEngine",
                         ("--ddp-backend", "gloo", "--no-ds3-gather", "--padding-free")),
}

MLP_TILE = 4  # tokens per tile of the *_tiling modes: fewer than any row's
TILING = ("--sgd", "--mlp-tile-tokens", str(MLP_TILE), "--recompute-attention")

# Launched only by the test that names it (not in the tests parametrized over MODES): loss_type='grpo' under SGD
# (lr 0.1) with sequence parallelism, compared with the 1-process run of the same settings (`run_reference`).
EXTRA_MODES = {
    "ddp_sp_grpo": Mode("ddp_sp.yaml", "MULTI_CPU", "DistributedDataParallel",
                        ("--loss-type", "grpo", "--sgd", "--sequence-parallel"), env=CPU),
    # modeling/tiling.py's two memory levers together, under each launch the memory planner may propose them
    # under, with SGD (lr 0.1) and compared with the 1-process run without them (test_tiling_multiprocess.py): the
    # sequence-tiled MLP and norms (`mlp_tile_tokens`: tiles of MLP_TILE tokens split every row, a 9-token prompt
    # and 1-10 completion tokens, and the processes' micro-batches differ in length, so their own numbers of tiles
    # differ; ZeRO-3 agrees on the largest) and the recomputed attention (`recompute_attention`: a row at a time,
    # under ZeRO-3 whole by design).
    "ddp_tiling": Mode("ddp.yaml", "MULTI_CPU", "DistributedDataParallel", TILING, env=CPU),
    "zero2_tiling": Mode("deepspeed_zero2.yaml", "DEEPSPEED", "DeepSpeedEngine", ("--ddp-backend", "gloo", *TILING)),
    "zero3_tiling": Mode("deepspeed_zero3.yaml", "DEEPSPEED", "DeepSpeedEngine",
                         ("--ddp-backend", "gloo", "--no-ds3-gather", *TILING)),
    "fsdp2_tiling": Mode("fsdp2.yaml", "FSDP", "FSDPModule", TILING, env=CPU),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "RANK", "WORLD_SIZE"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DS_BUILD_OPS": "0", **extra})
    return env


def accelerate_launch(config: str, script_args: list[str], env: dict, log: Path,
                      script: Path = HARNESS) -> tuple[int, float]:
    """Run `accelerate launch` of `script` to completion or timeout (then kill every process it started); returns
    the exit code and the wall time. Output goes to `log`."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               f"accelerate_configs/cpu/{config}", "--main_process_port", str(_free_port()), str(script),
               *script_args]
    start = time.perf_counter()
    code = run_bounded(command, REPO, env, log, LAUNCH_TIMEOUT_S)
    return code, time.perf_counter() - start


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("dist_models")
    harness.save_tiny_models(directory)
    return directory


@pytest.fixture(scope="session")
def run_mode(model_dir, tmp_path_factory):
    """`run_mode(name)` -> (result dict, output dir): one launch per mode per session."""
    cache: dict[str, tuple[dict, Path] | str] = {}  # a failed launch is kept as its message: no relaunch

    def run(name: str) -> tuple[dict, Path]:
        mode = {**MODES, **EXTRA_MODES}[name]
        if "deepspeed" in mode.config and importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (pip install '.[deepspeed]')")
        if name not in cache:
            out = tmp_path_factory.mktemp(f"dist_{name}")
            code, wall = accelerate_launch(mode.config, ["--out", str(out), "--model-dir", str(model_dir),
                                                         *mode.args], launch_env(mode.env), out / "launch.log")
            if code != 0 or not (out / "result.json").exists():
                cache[name] = (f"{name}: accelerate launch exited {code} after {wall:.0f}s (timeout "
                               f"{LAUNCH_TIMEOUT_S}s); last lines of its output:\n{_tail(out / 'launch.log')}")
            else:
                result = json.loads((out / "result.json").read_text())
                print(f"\n[distributed] {name}: launch {wall:.1f}s, train {result['train_seconds']:.1f}s")
                cache[name] = (result, out)
        if isinstance(cache[name], str):
            pytest.fail(cache[name])
        return cache[name]

    return run


@pytest.fixture(scope="session")
def run_reference(model_dir, tmp_path_factory):
    """`run_reference(lora, **options)` -> (result, output dir) of the 1-process run over the same global batch
    (`options`: harness.run's `loss_type`, `sgd`)."""
    cache: dict[tuple, tuple[dict, Path]] = {}

    def run(lora: bool, **options) -> tuple[dict, Path]:
        key = (lora, *sorted(options.items()))
        if key not in cache:
            name = "_".join(["lora" if lora else "full", *(f"{k}-{v}" for k, v in sorted(options.items()))])
            out = tmp_path_factory.mktemp(f"dist_reference_{name}")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # like each launched process; 2 threads on a busy 2-core CI box crawl
            try:
                cache[key] = (harness.run(out, model_dir, lora=lora, **options), out)
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return run
