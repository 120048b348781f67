"""Every shipped accelerate config goes through accelerate's own launch-time parsing, and the environment it
would hand the training processes selects the mode its name promises. No process is started: the GPU configs
cannot run on a CPU machine, and the CPU ones are launched for real in test_multiprocess.py."""

from __future__ import annotations

import json

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

from tests.distributed.conftest import REPO

# config -> (launcher, processes, machines, mixed precision, expected environment entries)
EXPECTED = {
    "single_gpu.yaml": ("simple", 1, 1, "bf16", {}),
    "multi_gpu.yaml": ("multi_gpu", 8, 1, "bf16", {}),
    "deepspeed_zero2.yaml": ("deepspeed", 8, 1, "bf16", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                                         "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"}),
    "deepspeed_zero3.yaml": ("deepspeed", 8, 1, "bf16", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                                                         "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
                                                         "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}),
    "deepspeed_zero3_offload.yaml": ("deepspeed", 8, 1, "bf16", {
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}),
    "fsdp2.yaml": ("multi_gpu", 8, 1, "bf16", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                                               "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
                                               "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}),
    "multi_node.yaml": ("deepspeed", 16, 2, "bf16", {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}),
    "cpu/ddp.yaml": ("multi_gpu", 2, 1, "no", {}),
    "cpu/ddp_sp.yaml": ("multi_gpu", 2, 1, "no", {}),  # sequence parallelism: plain DDP, GRPO shards positions
    "cpu/deepspeed_zero2.yaml": ("deepspeed", 2, 1, "no", {
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "accelerate_configs/cpu/deepspeed_zero2.json"}),
    "cpu/deepspeed_zero3.yaml": ("deepspeed", 2, 1, "no", {
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": "accelerate_configs/cpu/deepspeed_zero3.json"}),
    "cpu/fsdp2.yaml": ("multi_gpu", 2, 1, "no", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),
}


def test_every_shipped_config_is_listed():
    shipped = {str(p.relative_to(REPO / "accelerate_configs")) for p in (REPO / "accelerate_configs").rglob("*.yaml")}
    assert shipped == set(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_config_selects_its_mode(name, monkeypatch):
    monkeypatch.chdir(REPO)
    launcher, processes, machines, precision, expected_env = EXPECTED[name]
    args = launch_command_parser().parse_args(["--config_file", f"accelerate_configs/{name}", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert (args.num_processes, args.num_machines, args.mixed_precision) == (processes, machines, precision)
    if launcher == "deepspeed":
        assert args.use_deepspeed
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command
        _, env = prepare_deepspeed_cmd_env(args)
    elif launcher == "multi_gpu":
        assert args.multi_gpu or args.use_fsdp  # the torchrun launcher: several processes, also on CPU
        env = prepare_multi_gpu_env(args)
    else:
        assert not (args.multi_gpu or args.use_deepspeed or args.use_fsdp) and not args.cpu
        env = {}
    assert {k: env.get(k) for k in expected_env} == expected_env


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_deepspeed_json(stage):
    config = json.loads((REPO / f"accelerate_configs/cpu/deepspeed_zero{stage}.json").read_text())
    assert config["zero_optimization"]["stage"] == stage
    assert "optimizer" not in config  # torch AdamW: no DeepSpeed C++ optimizer to compile
    if stage == 3:  # a tiny model must really be partitioned
        assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
