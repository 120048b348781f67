"""On a CUDA GPU: `activation_offloading=True` (TRL's `OffloadActivations` around the training step) trains to the
weights of the run without it, and the loss forward's saved tensors leave the device: the backward starts with
fewer bytes allocated, by about what the plan moves to the host. The module imports and collects everywhere;
without a CUDA device each test is skipped, with the reason (the `gpu` marker, tests/conftest.py). On CPU the
option is refused (tests/config/test_validation.py), while TRL's manager itself, in its single-stream mode without
pinned memory on CPU tensors, is tested around the trainer's step (tests/trainer/test_activation_offloading.py) and
around the forward and backward below (tests/gpu/bodies.py's `offloaded_backward`, run by
tests/modeling/test_offloaded_backward.py); the plan is tested by hand (tests/planning/test_offloading_plan.py) and
the backward's transients are kept out of the hook (tests/modeling/test_recompute.py).

    python -m pytest -q tests/gpu/test_offloading_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.runtime import compat
from grpo_trainer.trainer import parts
from tests.gpu.bodies import offloaded_backward
from tests.helpers import make_args, make_trainer, model_of_kind

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)


@pytest.mark.parametrize("tile", [0, 64], ids=["untiled", "tiled"])
def test_offloaded_run_trains_to_the_same_weights(tokenizer, toy_dataset, tmp_path, tile):
    """Two SGD steps in float32 on cuda, with and without offloading (and with the tiled MLP, whose backward runs
    forwards of its own): the same weights within float32 rounding."""
    weights = []
    for offloading in (False, True):
        trainer = make_trainer(tmp_path / str(offloading), tokenizer, toy_dataset,
                               model=make_tiny_model(tokenizer, seed=7), optim="sgd", learning_rate=0.05,
                               max_completion_length=8, activation_offloading=offloading, mlp_tile_tokens=tile)
        trainer.train()
        weights.append({n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()})
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], atol=1e-5, rtol=1e-4, msg=name)


def _allocated(context) -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_the_saved_layer_inputs_leave_the_device(tokenizer, tmp_path):
    """A checkpointed float32 forward over 2 rows of 4,096 tokens, 8 layers of E = 256: at the backward's start the
    device holds fewer bytes with offloading, by at least half of the layers' inputs ([2, 4096, 256] float32 = 8 MiB
    each; TRL's manager keeps a few in flight), and the gradients are the same."""
    model = model_of_kind("qwen2", tokenizer, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                          max_position_embeddings=4096).cuda().train()
    compat.enable_checkpointing(model)
    ids = torch.randint(10, 90, (2, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask, T = torch.ones_like(ids), 4000
    layers, E = model.config.num_hidden_layers, model.config.hidden_size
    held, grads = [], []
    for offloading in (False, True):
        context = parts.activation_offloading(make_args(tmp_path, activation_offloading=offloading), model)
        torch.cuda.synchronize()
        step_grads, allocated = offloaded_backward(model, ids, mask, T, context, at_backward=_allocated)
        held.append(allocated)
        grads.append(step_grads)
    layer_inputs = layers * 2 * 4096 * E * 4
    assert held[0] - held[1] >= layer_inputs // 2, (held, layer_inputs)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)
