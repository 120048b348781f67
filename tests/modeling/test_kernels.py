"""`modeling.kernels`: float32 CPU products through oneDNN give PyTorch's values and gradients (to float
rounding), fall back to PyTorch's own path wherever they should, and `fast_linears` changes a model's modules only
for its duration. Speed is measured by benchmarks/, never here."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.modeling import kernels
from tests.helpers import force_onednn

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN chosen for every product, however small; the shapes of its calls' first operands."""
    force_onednn(monkeypatch)
    calls = []
    op = kernels._onednn_linear
    monkeypatch.setattr(kernels, "_onednn_linear", lambda *args: calls.append(args[0].shape) or op(*args))
    return calls


@pytest.mark.parametrize("shape", [(5, 24), (2, 7, 24)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_and_gradients_equal_f_linear(onednn, shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, requires_grad=True)
    weight = torch.randn(40, 24, generator=generator, requires_grad=True)
    bias = torch.randn(40, generator=generator, requires_grad=True) if with_bias else None
    upstream = torch.randn(*shape[:-1], 40, generator=generator)
    out = kernels.linear(x, weight, bias)
    assert onednn, "the product did not go through oneDNN"
    grads = torch.autograd.grad((out * upstream).sum(), [t for t in (x, weight, bias) if t is not None])
    expected = F.linear(x, weight, bias)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [t for t in (x, weight, bias) if t is not None])
    torch.testing.assert_close(out, expected, **TOL)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_a_frozen_weight_gets_no_gradient_and_no_weight_product(onednn):
    """LoRA's base layer: only the input's gradient is computed (one backward product, not two)."""
    x = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(32, 16)
    kernels.linear(x, weight).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(6, 32) @ weight, **TOL)
    assert weight.grad is None and len(onednn) == 2  # the forward and the input's gradient


def test_matmul_and_addmm_equal_torch_on_transposed_views(onednn, monkeypatch):
    monkeypatch.setattr(kernels, "ADDMM_BLOCK_ROWS", 4)
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(9, 5, generator=generator), torch.randn(5, 11, generator=generator)
    torch.testing.assert_close(kernels.matmul(a, b), a @ b, **TOL)
    torch.testing.assert_close(kernels.matmul(b.t(), a.t()), b.t() @ a.t(), **TOL)
    out = torch.randn(9, 11, generator=generator)
    expected = out.clone().addmm_(a, b, alpha=-1)
    kernels.addmm_(out, a, b, alpha=-1)  # three blocks of rows, the last one short
    torch.testing.assert_close(out, expected, **TOL)
    assert len(onednn) == 5


def test_what_onednn_should_not_compute_takes_pytorchs_own_path(monkeypatch):
    monkeypatch.setattr(kernels, "_choice", kernels.KernelChoice(True, True, "forced by the test"))
    calls = []
    monkeypatch.setattr(kernels, "_onednn_linear", lambda *args: calls.append(1))
    x, weight = torch.randn(4, 8), torch.randn(8, 8)
    assert torch.equal(kernels.linear(x, weight), F.linear(x, weight))  # below MIN_MACS
    monkeypatch.setattr(kernels, "MIN_MACS", 0)
    assert torch.equal(kernels.linear(x.double(), weight.double()), F.linear(x.double(), weight.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.linear(x, weight).dtype == torch.bfloat16  # autocast's cast, as F.linear under it
    monkeypatch.setattr(kernels, "_choice", kernels.KernelChoice(False, False, "forced by the test"))
    assert torch.equal(kernels.linear(x, weight), F.linear(x, weight))
    assert torch.equal(kernels.matmul(x, weight), x @ weight)
    assert calls == []


def test_the_environment_variable_forces_the_choice(monkeypatch):
    monkeypatch.setattr(kernels, "_choice", None)
    monkeypatch.setenv("GRPO_TRAINER_ONEDNN", "0")
    assert kernels.onednn_preferred() is False
    if kernels._onednn_op() is not None:
        monkeypatch.setattr(kernels, "_choice", None)
        monkeypatch.setenv("GRPO_TRAINER_ONEDNN", "1")
        assert kernels.onednn_preferred() is True


def _fresh(monkeypatch, tmp_path):
    """A process that has not chosen yet, with its measurement cache in `tmp_path`."""
    monkeypatch.setattr(kernels, "_choice", None)
    monkeypatch.delenv("GRPO_TRAINER_ONEDNN", raising=False)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    if kernels._onednn_op() is None:
        pytest.skip("this torch build has no oneDNN linear")


def test_the_choice_is_measured_once_per_machine_and_then_read_back(monkeypatch, tmp_path):
    """Decision 1: a stored measurement decides every later run on the machine, whatever the timing would say
    then: the second process (a fresh `_choice`) reads the file and measures nothing."""
    _fresh(monkeypatch, tmp_path)
    verdicts = iter([True, False])  # narrow: oneDNN faster; wide: not
    monkeypatch.setattr(kernels, "_measure", lambda *shapes: next(verdicts))
    first = kernels.kernel_choice()
    assert (first.narrow, first.wide) == (True, False) and "stored in" in first.source
    stored = json.loads((tmp_path / "kernels.json").read_text())
    assert stored == {kernels._machine_key(): {"narrow": True, "wide": False}}
    monkeypatch.setattr(kernels, "_choice", None)
    monkeypatch.setattr(kernels, "_measure", lambda *shapes: pytest.fail("measured again"))
    second = kernels.kernel_choice()
    assert (second.narrow, second.wide) == (True, False) and "measured once on this machine" in second.source
    # the classes: a decode step's product (8 rows) is narrow, a training forward's (512 rows) wide
    assert kernels.onednn_preferred(8) is True and kernels.onednn_preferred(512) is False


def test_a_numeric_disagreement_keeps_onednn_off(monkeypatch, tmp_path, caplog):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("GRPO_TRAINER_ONEDNN", "1")
    op = kernels._onednn_linear
    monkeypatch.setattr(kernels, "_onednn_linear", lambda x, w, b: op(x, w, b) * (1 + 1e-3))  # a wrong kernel
    with caplog.at_level("WARNING", logger="grpo_trainer.modeling.kernels"):
        choice = kernels.kernel_choice()
    assert not choice.any and "numeric check failed" in choice.source and "disagrees" in caplog.text
    x, weight = torch.randn(256, 1024), torch.randn(1024, 1024)
    assert torch.equal(kernels.linear(x, weight), F.linear(x, weight))  # never applied


def test_the_numeric_check_passes_for_the_real_kernel(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("GRPO_TRAINER_ONEDNN", "1")
    assert kernels._numeric_failure() is None
    assert kernels.kernel_choice() == kernels.KernelChoice(True, True, "GRPO_TRAINER_ONEDNN=1")


def _loss_gradients(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fast_linears_trains_a_model_to_the_same_gradients_and_restores_it(tokenizer, onednn, checkpointing):
    """Every linear of the model goes through oneDNN inside the context (also when activation checkpointing
    recomputes the layers in the backward pass: the saved tensors must match), none outside it."""
    model = make_tiny_model(tokenizer).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(10, 90, (3, 12), generator=torch.Generator().manual_seed(2))
    expected = _loss_gradients(model, ids)
    assert onednn == []
    with kernels.fast_linears(model, None, model):  # a model given twice is patched once
        fast = _loss_gradients(model, ids)
        forwards = len(onednn)
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    assert forwards >= len(layers) * (3 if checkpointing else 2)  # forward, (recompute,) input gradient
    assert all("forward" not in m.__dict__ for m in layers)  # the class's forward again
    assert set(fast) == set(expected)
    for name in expected:
        torch.testing.assert_close(fast[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fast_linears_leaves_hooked_and_wrapped_layers_alone(tokenizer, onednn):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    hooked = model.get_base_model().model.layers[0].mlp.down_proj
    hooked._hf_hook = object()  # accelerate's offloading hook owns this layer's forward
    with kernels.fast_linears(model):
        q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
        assert "forward" not in q_proj.__dict__  # PEFT's LoRA layer: its own forward, which calls its base layer
        assert "forward" in q_proj.base_layer.__dict__ and "forward" in q_proj.lora_A["default"].__dict__
        assert "forward" not in hooked.__dict__
    assert "forward" not in q_proj.base_layer.__dict__


def test_fast_linears_changes_nothing_where_onednn_is_not_preferred(tokenizer, monkeypatch):
    monkeypatch.setattr(kernels, "_choice", kernels.KernelChoice(False, False, "forced by the test"))
    model = make_tiny_model(tokenizer)
    with kernels.fast_linears(model):
        assert not any("forward" in m.__dict__ for m in model.modules())
