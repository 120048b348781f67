"""The planner's activation offloading (`activation_offloading`), by hand on the small shape with 8 layers on a GPU:
E 64, float32, 4 rows of 16 tokens, checkpointing.

The loss forward saves each layer's input and the embedding's and final norm's outputs, `[4, 16, 64]` float32 =
16,384 B each: (8 + 2) x 16,384 = 163,840 B. Offloaded, they are host memory; the device keeps TRL's stash of
tensors in flight, 5 at the forward's end (81,920 B) and 2 in the backward (32,768 B)."""

import dataclasses

import pytest

from grpo_trainer.planning import estimate, plan_memory
from tests.planning.shapes import SETTINGS, SHAPE

EIGHT = dataclasses.replace(SHAPE, layers=8)
GPU = dataclasses.replace(SETTINGS, device="cuda")
F, BS, BE = (estimate.INSTANTS.index(name) for name in ("loss forward", "backward start", "backward end"))


def _items(settings, shape=EIGHT):
    return {item.name: item for item in plan_memory(settings, shape).items}


def test_the_saved_tensors_move_to_the_host_and_the_stash_stays_by_hand():
    plain, offloaded = _items(GPU), _items(GPU.with_forward(activation_offloading=True))
    assert plain["activations"].bytes[F] == offloaded["activations"].bytes[F] == 163_840
    assert not plain["activations"].host and offloaded["activations"].host
    assert "offloading stash" not in plain
    stash = offloaded["offloading stash"]
    assert (stash.bytes[F], stash.bytes[BS], stash.bytes[BE]) == (81_920, 32_768, 32_768) and not stash.host
    device = (plan_memory(GPU, EIGHT).totals(host=False),
              plan_memory(GPU.with_forward(activation_offloading=True), EIGHT).totals(host=False))
    assert device[0][F] - device[1][F] == 163_840 - 81_920  # forward's end: the saved tensors less the stash
    # backward end: the plain run keeps the first layer's input [4, 16, 64] float32 = 16,384 B for its recomputation,
    # the offloaded one has it on the host and 2 such tensors in flight
    assert device[1][BE] - device[0][BE] == 32_768 - 16_384


def test_without_checkpointing_the_stash_holds_the_widest_saved_tensors():
    """Every layer's tensors are saved; the widest is an MLP intermediate, [4, 16, 128] float32 = 32,768 B: 5 of them
    (163,840 B) at the forward's end, 2 (65,536 B) in the backward."""
    settings = dataclasses.replace(GPU, checkpointing=False).with_forward(activation_offloading=True)
    stash = _items(settings)["offloading stash"]
    assert (stash.bytes[F], stash.bytes[BS]) == (163_840, 65_536)


def test_the_stash_is_at_most_what_is_saved():
    """2 layers: (2 + 2) x 16,384 = 65,536 B saved, fewer than 5 tensors: the stash is all of them."""
    stash = _items(GPU.with_forward(activation_offloading=True), SHAPE)["offloading stash"]
    assert (stash.bytes[F], stash.bytes[BS]) == (65_536, 32_768)


@pytest.mark.parametrize("offloading", [False, True])
def test_on_cpu_nothing_moves(offloading):
    """On CPU the trainer refuses the option (tests/config/test_validation.py); the plan is the plain one."""
    settings = SETTINGS.with_forward(activation_offloading=offloading)
    assert plan_memory(settings, EIGHT).items == plan_memory(SETTINGS, EIGHT).items
