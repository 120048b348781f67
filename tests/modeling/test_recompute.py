"""Forwards run inside a backward (the tiled MLP's tiles, a replayed layer) keep their saved tensors as they are: a
saved-tensor hook installed around the whole training step, as activation offloading installs TRL's
`OffloadActivations`, sees only the loss forward's tensors, never the backward's transients. Without
`recompute.transient_saves` (the negative controls) both send their transients through the outer hook."""

import contextlib
import dataclasses

import pytest
import torch

from grpo_trainer.modeling import forwards, recompute, replay, tiling
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.runtime import compat
from tests.helpers import fast_rollout, greedy_config, grouped_prompts, model_of_kind


class _OuterHook:
    """A saved-tensor hook around forward and backward (what offloading installs), counting what it is given in
    each phase; the tensors are returned as they are."""

    def __init__(self) -> None:
        self.phase, self.packed = "forward", {"forward": 0, "backward": 0}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed[self.phase] += 1
        return tensor

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _without_the_fix(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "transient_saves", contextlib.nullcontext)


@pytest.mark.parametrize("fixed", [True, False], ids=["transient_saves", "negative_control"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_tiled_mlps_backward_saves_nothing_through_an_outer_hook(tokenizer, checkpointing, fixed, monkeypatch):
    """The loss forward with tiles of 7 tokens under an outer hook: the forward hands it tensors (each TiledMLP's
    input among them; under checkpointing each layer's input), the backward none. Without the fix the tiles'
    recomputation hands it each tile's intermediates."""
    if not fixed:
        _without_the_fix(monkeypatch, tiling)
    model = model_of_kind("qwen2", tokenizer, max_position_embeddings=256)
    if checkpointing:
        compat.enable_checkpointing(model)
    model.train()
    ids = torch.randint(10, 90, (2, 30), generator=torch.Generator().manual_seed(0))
    mask, T = torch.ones_like(ids), 24
    settings = dataclasses.replace(forwards.ForwardSettings(padding_free=False), mlp_tile_tokens=7)
    outer = _OuterHook()
    forwards._VERDICTS.clear()
    with outer.hooks():
        loss = forwards.score(model, ids, mask, T, settings).logps.sum()
        outer.phase = "backward"
        loss.backward()
    assert outer.packed["forward"] > 0
    assert (outer.packed["backward"] == 0) == fixed, outer.packed
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("fixed", [True, False], ids=["transient_saves", "negative_control"])
def test_a_replayed_layers_backward_saves_nothing_through_an_outer_hook(tokenizer, fixed, monkeypatch):
    """The rollout's layer outputs replayed in a checkpointed forward under an outer hook: the forward hands it the
    layers' inputs, the backward (each layer run again on its input) none; without the fix, the layers' tensors."""
    if not fixed:
        _without_the_fix(monkeypatch, replay)
    model = model_of_kind("qwen2", tokenizer)
    compat.enable_checkpointing(model)
    model.train()
    prompts = grouped_prompts(tokenizer)
    torch.manual_seed(3)
    rollout = fast_rollout(model, prompts, greedy_config(tokenizer, do_sample=True, max_new_tokens=10),
                           layer_outputs=True)
    T = rollout.completion_ids.shape[1]
    input_ids = torch.cat([prompts.ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([prompts.mask, rollout.completion_mask], 1)
    outer = _OuterHook()
    with outer.hooks():
        with replay.replayed_layers(model.get_decoder().layers, rollout.sampler.replay.layer_outputs):
            logps = completion_logprobs(model, input_ids, attention_mask, T, known_logps=rollout.sampler.logps).logps
        loss = (logps * rollout.completion_mask).sum()
        outer.phase = "backward"
        loss.backward()
    assert outer.packed["forward"] > 0
    assert (outer.packed["backward"] == 0) == fixed, outer.packed


def test_transient_saves_hands_autograd_the_tensors_themselves():
    """Inside the context an outer hook is not called, and the backward reads the very tensors saved."""
    outer = _OuterHook()
    x = torch.randn(4, 3, requires_grad=True)
    with outer.hooks(), recompute.transient_saves():
        y = (x * x).sum()
    y.backward()
    assert outer.packed == {"forward": 0, "backward": 0}
    torch.testing.assert_close(x.grad, 2 * x.detach())
