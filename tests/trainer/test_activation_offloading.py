"""TRL's activation-offloading manager (`trl.models.activation_offloading.OffloadActivations`, what
`activation_offloading=True` installs around each training step on a GPU) around our real training steps, on CPU:
the CPU stands in for the accelerator (TRL's manager reads `torch.accelerator.current_accelerator()`), in its
single-stream mode without pinned memory (CPU-only torch has neither side streams nor pinning). Every saved tensor
of the loss forward goes through the manager's copy-out and copy-back, and one SGD step moves the weights exactly as
the run without it: with checkpointing, with the tiled MLP (whose backward runs forwards of its own,
`modeling/recompute.py`) and with the reference model's KL term. The GPU run (side stream, pinned memory, bytes on
the device) is tests/gpu/test_offloading_cuda.py."""

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from tests.helpers import sgd_step_args, sgd_step_deltas


def _cpu_offloading(monkeypatch):
    """TRL's manager with the CPU as its accelerator: every saved tensor of 1 KiB or more, not a parameter, is
    copied out when saved and back when the backward reads it; counts how many it copied."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    from trl.models.activation_offloading import OffloadActivations

    manager = OffloadActivations(use_pin_memory=False, use_streams=False)
    copied, pack = [0], manager.pack_hook

    def counted(tensor):
        tensor_id = pack(tensor)
        copied[0] += bool(manager.tracker[tensor_id][1])  # (tensor, modified, ...): modified = copied out
        return tensor_id

    manager.pack_hook = counted
    return manager, copied


@pytest.mark.parametrize("tile", [0, 5], ids=["untiled", "tiled"])
def test_an_offloaded_step_equals_the_plain_one(tmp_path, tokenizer, monkeypatch, tile):
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    plain = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "plain", mlp_tile_tokens=tile))
    manager, copied = _cpu_offloading(monkeypatch)
    offloaded = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "offloaded", mlp_tile_tokens=tile),
                                manager)
    assert copied[0] > 0  # the manager really took the forward's tensors
    assert max(plain[n].abs().max().item() for n in plain) > 1e-4  # the step moved the weights
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_trainer_installs_the_manager_only_when_asked(tmp_path, tokenizer, monkeypatch):
    """`activation_offloading=False` (CPU, the default): no manager. With an accelerator it is TRL's, built for the
    trainer's model (its parameters are never offloaded)."""
    import contextlib

    from grpo_trainer.trainer import parts

    args = sgd_step_args(tmp_path)
    assert isinstance(parts.activation_offloading(args, torch.nn.Linear(2, 2)), contextlib.nullcontext)
    manager, _ = _cpu_offloading(monkeypatch)
    args = sgd_step_args(tmp_path, activation_offloading=True)  # accepted: the CPU stands in for an accelerator
    model = make_tiny_model(tokenizer)
    built = parts.activation_offloading(args, model)
    assert type(built) is type(manager)
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= built.param_storages
