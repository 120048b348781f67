"""TRL's activation-offloading manager around a checkpointed `forwards.score` forward and its backward, on CPU: the
body of tests/gpu/test_offloading_cuda.py's "saved layer inputs leave the device" (tests/gpu/bodies.py's
`offloaded_backward`). The CPU stands in for the accelerator (TRL's manager reads
`torch.accelerator.current_accelerator()` when it is built), in the manager's single-stream mode without pinned
memory (CPU-only torch has neither side streams nor pinning): every layer's saved input goes through the manager's
copy-out at the forward and copy-back at the backward, and the gradients are those of the run without it. The
trainer refuses `activation_offloading=True` on CPU (`trainer.setup.check_device`), so the manager is built here as
`trainer.parts.activation_offloading` builds it, with the arguments CPU tensors allow; the trainer's step under it is
tests/trainer/test_activation_offloading.py."""

import contextlib

import pytest
import torch

from grpo_trainer.runtime import compat
from tests.gpu.bodies import offloaded_backward
from tests.helpers import model_of_kind


def _cpu_manager(model):
    """TRL's manager for `model` (its parameters never offloaded), built with the CPU as its accelerator: it copies
    every saved tensor of 1 KiB or more on that device out when saved and back when the backward reads it."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cpu"))
        return get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)


def _copied_out(manager) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each saved tensor the manager holds as its host copy: TRL's tracker maps a saved tensor's
    id to (tensor, copied, ...), `copied` where it took the tensor out."""
    if not hasattr(manager, "tracker"):
        return []
    return [(tuple(tensor.shape), tensor.nbytes) for tensor, copied, *_ in manager.tracker.values() if copied]


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "plain"])
def test_the_saved_tensors_go_through_the_manager_and_the_gradients_stay(tokenizer, checkpointing):
    """2 rows of 64 tokens, 2 layers of E = 64: at the backward's start the manager holds a host copy of each
    layer's input ([2, 64, 64] float32 = 32 KiB; with checkpointing, what a layer saves), none after it, and the
    gradients equal the run without it within float32 rounding (the copies are exact; their layout, contiguous
    from offset 0, may change a kernel's blocking)."""
    model = model_of_kind("qwen2", tokenizer)
    if checkpointing:
        compat.enable_checkpointing(model)
    model.train()
    ids = torch.randint(10, 90, (2, 64), generator=torch.Generator().manual_seed(0))
    mask, T = torch.ones_like(ids), 56
    layers, E = model.config.num_hidden_layers, model.config.hidden_size
    plain, none_copied = offloaded_backward(model, ids, mask, T, contextlib.nullcontext(), at_backward=_copied_out)
    manager = _cpu_manager(model)
    grads, copied = offloaded_backward(model, ids, mask, T, manager, at_backward=_copied_out)
    assert none_copied == []
    assert copied.count(((2, 64, E), 2 * 64 * E * 4)) >= layers, copied
    assert not manager.tracker  # every copy was read back by the backward
    assert grads.keys() == plain.keys() and all(g.abs().max() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_manager_is_reused_across_steps(tokenizer):
    """The trainer builds one manager and enters it every step (`GRPOTrainer.offloading`): a second step under the
    same manager copies the same tensors out again and gives the same gradients as the first."""
    model = model_of_kind("qwen2", tokenizer)
    compat.enable_checkpointing(model)
    model.train()
    ids = torch.randint(10, 90, (2, 64), generator=torch.Generator().manual_seed(1))
    mask, T = torch.ones_like(ids), 40
    manager = _cpu_manager(model)
    first, copied_first = offloaded_backward(model, ids, mask, T, manager, at_backward=_copied_out)
    second, copied_second = offloaded_backward(model, ids, mask, T, manager, at_backward=_copied_out)
    assert copied_first and copied_second == copied_first
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=0, msg=name)
