"""grpo_trainer.runtime.distributed in one process: the launch checks, the ZeRO-3 reference model, the FSDP log-prob
path and the parameter gathering, plus one real wrong launch that must now fail instead of exiting 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from grpo_trainer.modeling import logprobs as logprobs_module
from grpo_trainer.modeling import unwrap
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.runtime import distributed, models
from tests.distributed.conftest import MODES, accelerate_launch, launch_env
from tests.parameters import full_parameters, parameter_digest


def _accelerator(num_processes: int, distributed_type: DistributedType, deepspeed: bool = False):
    state = SimpleNamespace(distributed_type=distributed_type, deepspeed_plugin=object() if deepspeed else None)
    return SimpleNamespace(num_processes=num_processes, state=state, distributed_type=distributed_type)


@pytest.mark.parametrize("num_processes, distributed_type, deepspeed, fix", [
    (1, DistributedType.NO, False, "ACCELERATE_USE_CPU=true"),  # torchrun launcher, no CPU flag
    (2, DistributedType.NO, False, "ACCELERATE_USE_CPU=true"),  # ddp_backend='gloo' but no CPU flag
    (1, DistributedType.DEEPSPEED, True, "ddp_backend='gloo'"),  # DeepSpeed on CPU without gloo
])
def test_launch_that_would_not_sync_is_refused(monkeypatch, num_processes, distributed_type, deepspeed, fix):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2") as error:
        distributed.check_processes(_accelerator(num_processes, distributed_type, deepspeed))
    assert fix in str(error.value)


@pytest.mark.parametrize("world_size, accelerator", [
    ("2", _accelerator(2, DistributedType.MULTI_CPU)),
    ("2", _accelerator(2, DistributedType.DEEPSPEED, deepspeed=True)),
    (None, _accelerator(1, DistributedType.NO)),  # a plain `python train.py`
])
def test_synced_launch_passes(monkeypatch, world_size, accelerator):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    distributed.check_processes(accelerator)


def test_fsdp1_on_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(RuntimeError, match="fsdp_version: 2"):
        distributed.enable_fsdp2_on_cpu(None, None)


def test_fsdp_logprobs_equal_the_memory_lean_path(tiny_model, monkeypatch):
    """Same log-probs, entropies and gradients as completion_logprobs (here on an unsharded model), also when
    the completion positions are split into several chunks."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, 90, (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    results = []
    for sharded in (False, True):  # the FSDP2 path: the head inside the model's forward, logits scored in chunks
        monkeypatch.setattr(logprobs_module, "is_fsdp_module", lambda model, sharded=sharded: sharded)
        tiny_model.zero_grad()
        out = completion_logprobs(tiny_model, input_ids, attention_mask, 5, temperature=0.7, chunk_size=4,
                                  with_entropy=True)
        logps, entropy = out.logps, out.entropy
        logps.sum().backward()
        results.append((logps.detach(), entropy, [p.grad.clone() for p in tiny_model.parameters()]))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    assert lp_a.shape == (3, 5)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def _as_if_partitioned(model):
    for i, p in enumerate(model.parameters()):
        p.ds_id = i  # what deepspeed.zero.Init leaves on every parameter
    return model


def test_zero3_reference_is_loaded_from_the_checkpoint(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    policy = type(tiny_model).from_pretrained(tmp_path)
    with torch.no_grad():
        for p in policy.parameters():
            p.zero_()  # a partitioned policy holds no weights; the reference must not copy it
    reference = models.make_reference_model(_as_if_partitioned(policy), 0.04, None)
    assert not unwrap.is_zero3_partitioned(reference) and not reference.training
    for (name, ref), (_, saved) in zip(reference.named_parameters(), tiny_model.named_parameters()):
        assert torch.equal(ref, saved) and not ref.requires_grad, name


def test_zero3_reference_without_a_checkpoint_is_refused(tiny_model):
    tiny_model.config._name_or_path = ""
    with pytest.raises(ValueError, match="_name_or_path"):
        models.make_reference_model(_as_if_partitioned(tiny_model), 0.04, None)
    assert models.make_reference_model(tiny_model, 0.0, None) is None  # beta 0: no reference at all


def test_full_parameters_and_digest(tiny_model):
    params = full_parameters(tiny_model)
    assert params.keys() == dict(tiny_model.named_parameters()).keys()
    digest = parameter_digest(params)
    assert parameter_digest(full_parameters(tiny_model)) == digest
    params["model.norm.weight"][0] += 1e-6
    assert parameter_digest(params) != digest


@pytest.mark.distributed
def test_real_launch_without_cpu_flag_fails_loudly(model_dir, tmp_path):
    """`accelerate launch` with the DDP config but without ACCELERATE_USE_CPU starts 2 processes that
    accelerate leaves unsynchronised; before the check this exited 0 after training two separate copies."""
    env = launch_env({})  # no ACCELERATE_USE_CPU
    args = ["--out", str(tmp_path), "--model-dir", str(model_dir), "--per-device-batch", "4"]
    code, _ = accelerate_launch(MODES["ddp"].config, args, env, tmp_path / "launch.log")
    log = (tmp_path / "launch.log").read_text(errors="replace")
    assert code != 0
    assert "2 processes were launched (WORLD_SIZE=2), but accelerate sees" in log
    assert "ACCELERATE_USE_CPU=true" in log
