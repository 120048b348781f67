"""GRPO with 2 processes over gloo, in each mode CI can run on CPU: DDP, DeepSpeed ZeRO-2, ZeRO-3 (sharded
generation), FSDP2 and LoRA + DDP.

A wrong launch can exit 0 while training nothing in parallel (one process; two unsynced copies; DDP instead of
FSDP; ZeRO-3 that partitions nothing), so the first tests check what each launch really ran. The rest compare
the run with a 1-process run over the same global batch: the harness makes a row's sampled completion
independent of the process that generates it, so rollouts, rewards, advantages, logged metrics and the final
weights must all match. See harness.py for the run itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import MODES

pytestmark = pytest.mark.distributed

FULL_MODES = [name for name, mode in MODES.items() if not mode.lora]
PARAM_TOL = 1e-5  # seen: <= 3e-6 after 3 AdamW steps at lr 1e-3 (1e-2 for LoRA)


def _params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "params.pt")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _completion_rows(out: Path) -> list[dict]:
    files = sorted((out / "run" / "completions").glob("completions_*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


@pytest.mark.parametrize("name", MODES)
def test_launch_really_runs_two_synced_processes(name, run_mode):
    result, _ = run_mode(name)
    mode = MODES[name]
    assert result["num_processes"] == 2
    assert result["distributed_type"] == mode.distributed_type
    assert mode.wrapper in result["wrapped_mro"], result["wrapped_mro"]
    rank0, rank1 = result["ranks"]
    assert rank0["digest"] == rank1["digest"], "the processes ended with different parameters"
    for round0, round1 in zip(rank0["rounds"], rank1["rounds"]):
        assert round0["completions"] != round1["completions"]
        assert round0["prompts"] != round1["prompts"]  # 3 prompts x G=4 over 6 + 6 rows


@pytest.mark.parametrize("name", MODES)
def test_processes_agree_on_each_rounds_prompt_groups(name, run_mode, run_reference):
    """The 2 processes' rows of a round, in process order, are the 1-process run's round: whole groups of G
    copies of one prompt, with the middle group split across the two processes."""
    result, _ = run_mode(name)
    reference, _ = run_reference(MODES[name].lora)
    rank0, rank1 = result["ranks"]
    expected = [r["prompts"] for r in reference["ranks"][0]["rounds"]]
    assert [a["prompts"] + b["prompts"] for a, b in zip(rank0["rounds"], rank1["rounds"])] == expected
    for prompts in expected:
        groups = [prompts[i:i + 4] for i in range(0, len(prompts), 4)]
        assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 3
    assert rank0["rounds"][0]["prompts"][-2:] == rank1["rounds"][0]["prompts"][:2]  # a group spans processes


@pytest.mark.parametrize("name", MODES)
def test_rollouts_rewards_and_advantages_match_single_process(name, run_mode, run_reference):
    """Rewards are gathered before advantages and each process keeps its own slice: the completion log (the
    main process's gather of every row) equals the 1-process run's, advantage for advantage."""
    _, out = run_mode(name)
    _, ref_out = run_reference(MODES[name].lora)
    rows, ref_rows = _completion_rows(out), _completion_rows(ref_out)
    assert len(rows) == len(ref_rows) == 3 * 12
    for row, ref in zip(rows, ref_rows):
        assert (row["step"], row["prompt"], row["completion"]) == (ref["step"], ref["prompt"], ref["completion"])
        for key in ("copy_digits_reward", "reward", "advantage"):
            assert row[key] == pytest.approx(ref[key], abs=1e-5), (key, row, ref)


@pytest.mark.parametrize("name", MODES)
def test_weights_match_single_process_run(name, run_mode, run_reference, model_dir):
    from safetensors.torch import load_file

    _, out = run_mode(name)
    _, ref_out = run_reference(MODES[name].lora)
    params, ref = _params(out), _params(ref_out)
    assert _max_diff(params, ref) < PARAM_TOL
    # ...while training moved the weights far more than that, so the match is not vacuous.
    if MODES[name].lora:
        moved = max(v.abs().max().item() for k, v in ref.items() if "lora_B" in k)  # B starts at 0
    else:
        initial = load_file(model_dir / "policy" / "model.safetensors")
        moved = max((ref[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * PARAM_TOL


@pytest.mark.parametrize("name", MODES)
def test_logged_metrics_are_global(name, run_mode, run_reference):
    """Rollout metrics come from gathered rows: equal to the 1-process run. Loss metrics are averaged over the
    processes: what the main process logs is the mean of the two processes' own values."""
    result, _ = run_mode(name)
    reference, _ = run_reference(MODES[name].lora)
    logs = [h for h in result["log_history"] if "reward" in h]
    ref_logs = [h for h in reference["log_history"] if "reward" in h]
    assert len(logs) == len(ref_logs) == 3
    for log, ref in zip(logs, ref_logs):
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "completions/max_length",
                    "num_tokens", "rewards/copy_digits_reward/mean"):
            assert log[key] == pytest.approx(ref[key], abs=1e-5), key
    rank0, rank1 = result["ranks"]
    for log, local0, local1 in zip(logs, rank0["local_metrics"], rank1["local_metrics"]):
        for key in ("entropy", "kl"):
            assert log[key] == pytest.approx((local0[key] + local1[key]) / 2, abs=1e-6), key
    pairs = list(zip(rank0["local_metrics"], rank1["local_metrics"]))
    if name == "ddp_sp":  # both processes score every share (each its half of the positions): same metrics
        assert all(a["entropy"] == pytest.approx(b["entropy"], abs=1e-6) for a, b in pairs)
    else:
        assert any(a["entropy"] != b["entropy"] for a, b in pairs)


@pytest.mark.parametrize("name", MODES)
def test_only_main_process_writes_completions(name, run_mode):
    result, out = run_mode(name)
    rank0, rank1 = result["ranks"]
    assert rank0["flushes"] and not rank1["flushes"]
    assert {row["step"] for row in _completion_rows(out)} == {1, 2, 3}


@pytest.mark.parametrize("name", MODES)
def test_saved_model_loads_back_the_trained_weights(name, run_mode, model_dir):
    from transformers import AutoModelForCausalLM

    _, out = run_mode(name)
    if MODES[name].lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(model_dir / "policy")
        loaded = PeftModel.from_pretrained(base, out / "saved")
    else:
        loaded = AutoModelForCausalLM.from_pretrained(out / "saved")
    assert _max_diff(dict(loaded.named_parameters()), _params(out)) == 0.0


@pytest.mark.parametrize("name", MODES)
def test_generation_with_different_lengths_per_process(name, run_mode):
    """After training, the trainer's own sampling: the same prompt gives different completions on the two
    processes (each is seeded differently), and process r generating 3 + 5r tokens does not hang or crash,
    also with sharded weights (FSDP2, ZeRO-3 without gathering)."""
    result, _ = run_mode(name)
    probes = [r["probe"] for r in result["ranks"]]
    assert probes[0]["same_prompt"] != probes[1]["same_prompt"]
    for key in (k for k in probes[0] if k.startswith("uneven")):
        assert [len(p[key][0]) for p in probes] == [3, 8], key


def test_zero3_partitions_every_model_and_generates_alike_gathered_or_not(run_mode):
    result, _ = run_mode("zero3")
    assert result["zero3"]
    for rank in result["ranks"]:
        sharding = rank["sharding"]
        assert sharding["local_numel"] == 0 and sharding["zero3_not_available"] == sharding["params"]
        assert 0 < sharding["zero3_partition_numel"] < 81_000 * 0.6  # about half of the 80,960 elements each
        assert rank["probe"]["uneven_gather_True"] == rank["probe"]["uneven_gather_False"]
    assert "DeepSpeedEngine" in result["ref_model_mro"] and "DeepSpeedEngine" in result["reward_model_mro"]


def test_fsdp2_shards_policy_and_reference(run_mode):
    result, _ = run_mode("fsdp2")
    assert result["model_class"].startswith("FSDP")
    for rank in result["ranks"]:
        sharding = rank["sharding"]
        assert sharding["dtensor_params"] == sharding["params"]
        assert sharding["local_numel"] < 81_000 * 0.6
    assert "FSDPModule" in result["ref_model_mro"]


def test_lora_ddp_trains_only_the_adapter(run_mode, model_dir):
    from safetensors.torch import load_file

    _, out = run_mode("lora_ddp")
    params = _params(out)
    initial = load_file(model_dir / "policy" / "model.safetensors")
    base = {k: v for k, v in params.items() if "lora_" not in k}
    for name, value in base.items():
        original = name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")
        assert torch.equal(value, initial[original]), name
    assert all(v.abs().max() > 0 for k, v in params.items() if "lora_B" in k)


@pytest.mark.parametrize("name", [name for name in MODES if name.endswith("_packed")])
def test_packed_modes_ran_packed_forwards_on_every_process(name, run_mode):
    """padding_free: each process passed the self-check of the policy and of the reference model (two packed
    forwards each) and packed micro-batches' log-prob forwards (of 3 steps x 2 micro-steps x policy and reference;
    a micro-batch of equally long sequences gains nothing and runs padded), while the weights match the padded
    1-process run (test_weights_match_single_process_run)."""
    result, _ = run_mode(name)
    counts = [rank["packed_forwards"] for rank in result["ranks"]]
    if name == "zero3_packed":  # a partitioned head runs inside the forward: packing refused by rule, scored padded
        assert counts == [0, 0]
    else:
        assert all(count >= 2 * 2 + 2 for count in counts), counts


def test_sequence_parallel_mode_sharded_every_policy_and_reference_forward(run_mode):
    """sp_size=2: every micro-step (3 steps x 2 micro-steps) ran one sharded policy forward per process's rows (ALST's
    loop: 2 shares) and, when its micro-batch was prepared, one sharded reference forward per share (beta=0.04; one
    forward each: a share's rows are `rows_per_forward`), on both processes, each scoring its half of the share's
    positions, while the weights match the unsharded 1-process run (test_weights_match_single_process_run[ddp_sp]);
    the other modes ran none."""
    result, _ = run_mode("ddp_sp")
    policy = reference = 3 * 2 * 2
    assert [rank["sharded_forwards"] for rank in result["ranks"]] == [policy + reference] * 2
    assert [rank["sharded_forwards"] for rank in run_mode("ddp")[0]["ranks"]] == [0, 0]


def test_sequence_parallel_grpo_loss_matches_the_unsharded_run(run_mode, run_reference, model_dir):
    """loss_type='grpo' (a mean over rows): each share's loss is its process's DDP loss, unscaled, so under SGD,
    where a gradient's scale shows in the weights (the gathered layout this loop replaced needed a factor of
    sp_size on the loss; a wrong factor moves them 2x or 0.5x as far each step), the weights after 3 steps with
    sp_size=2 equal the 1-process run's over the same global batch (DDP's average of the two processes' means is
    that run's mean: test_weights_match_single_process_run[ddp]), and training moved them."""
    sp = _params(run_mode("ddp_sp_grpo")[1])
    unsharded = _params(run_reference(False, loss_type="grpo", sgd=True)[1])
    assert _max_diff(sp, unsharded) < PARAM_TOL
    from safetensors.torch import load_file

    initial = load_file(model_dir / "policy" / "model.safetensors")
    assert max((unsharded[k] - initial[k]).abs().max().item() for k in initial) > 100 * PARAM_TOL


def test_backends_agree_with_each_other(run_mode):
    params = {name: _params(run_mode(name)[1]) for name in FULL_MODES}
    first = FULL_MODES[0]
    for name in FULL_MODES[1:]:
        assert _max_diff(params[name], params[first]) < PARAM_TOL, name
