"""On a CUDA GPU: `activation_offloading=True` (TRL's `OffloadActivations` around the training step) trains to the
weights of the run without it, and the loss forward's saved tensors leave the device: the backward starts with
fewer bytes allocated, by about what the plan moves to the host. Skipped, with the reason, without CUDA; on CPU the
option is refused (tests/config/test_validation.py), the plan is tested by hand (tests/planning/
test_offloading_plan.py) and the backward's transients are kept out of the hook (tests/modeling/test_recompute.py).

    python -m pytest -q tests/gpu/test_offloading_cuda.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests need one", allow_module_level=True)

from grpo_trainer.cli.toy import make_tiny_model  # noqa: E402
from grpo_trainer.modeling import forwards  # noqa: E402
from grpo_trainer.runtime import compat  # noqa: E402
from grpo_trainer.trainer import parts  # noqa: E402
from tests.helpers import make_args, make_trainer, model_of_kind  # noqa: E402


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


def test_the_saved_layer_inputs_leave_the_device(tokenizer, tmp_path):
    """A checkpointed float32 forward over 2 rows of 4,096 tokens, 8 layers of E = 256: at the backward's start the
    device holds fewer bytes with offloading, by at least half of the layers' inputs ([2, 4096, 256] float32 = 8 MiB
    each; TRL's manager keeps a few in flight), and the gradients are the same."""
    model = model_of_kind("qwen2", tokenizer, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                          max_position_embeddings=4096).cuda().train()
    compat.enable_checkpointing(model)
    ids = torch.randint(10, 90, (2, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask, T = torch.ones_like(ids), 4000
    settings = forwards.ForwardSettings(padding_free=False)
    layers, E = model.config.num_hidden_layers, model.config.hidden_size
    held, grads = [], []
    for offloading in (False, True):
        context = parts.activation_offloading(make_args(tmp_path, activation_offloading=offloading), model)
        model.zero_grad()
        torch.cuda.synchronize()
        with context:
            loss = forwards.score(model, ids, mask, T, settings).logps.sum()
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        del loss
    layer_inputs = layers * 2 * 4096 * E * 4
    assert held[0] - held[1] >= layer_inputs // 2, (held, layer_inputs)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)
