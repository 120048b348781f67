"""Two processes (`accelerate launch`, DDP over gloo on CPU) train with vLLM: against one server, or each with its
own engine (colocate, vLLM's external launcher on the trainer's process group). Each process gets its own rows'
completions, the weights pushed are the synchronised ones, and the greedy completions after training equal each
process's own `generate`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_bounded
from tests.vllm_integration.vllm_helpers import REPO, free_port

LAUNCH_TIMEOUT_S = 480
LOGP_ATOL = 1e-4


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_two_processes_train_with_vllm(tmp_path, served_model, request, mode):
    script = Path(__file__).with_name("multiprocess_run.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu/ddp.yaml",
               "--main_process_port", str(free_port()), str(script), "--out", str(tmp_path), "--model",
               str(served_model)]
    if mode == "server":
        command += ["--url", request.getfixturevalue("vllm_server")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
    log = tmp_path / "launch.log"
    code = run_bounded(command, REPO, env, log, LAUNCH_TIMEOUT_S)
    assert code == 0, log.read_text()[-6000:]
    assert "Traceback" not in log.read_text()  # vLLM's engines shut down cleanly at exit
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["processes"] for r in results] == [2, 2]
    # each process trained on its own rows and received the completions of those rows
    first = [r["first_round"] for r in results]
    assert first[0]["prompt_ids"] != first[1]["prompt_ids"]
    assert all(len(f["completion_ids"]) == len(f["prompt_ids"]) == 4 for f in first)
    assert first[0]["completion_ids"] != first[1]["completion_ids"]  # sampled at temperature 1 from the start weights
    # every round's server log-probs matched the (synchronised) policy's on each process's own prompts: the pushes
    # carried the trained weights, and no process received another's completions (their log-probs would not match)
    for r in results:
        steps = [h for h in r["log_history"] if "sampling/sampling_logp_difference/max" in h]
        assert len(steps) == 3 and all(h["sampling/sampling_logp_difference/max"] < LOGP_ATOL for h in steps)
    assert results[0]["digest"] == results[1]["digest"]  # DDP kept the processes' weights equal
    for r in results:
        assert r["served"] == r["generate"]  # through the server, for this process's own prompts
    # (the greedy completions of the two processes' prompts may coincide after training, e.g. both an immediate EOS,
    # so which process received which completions is checked on the sampled rounds above, not here)
