"""The trainer's rollouts are the model's: greedy completions equal `model.generate`'s whatever the architecture, a
patched `generate` is what runs (as in TRL's own tests), and a model that produces NaN logits is reported as such."""

import math
from unittest import mock

import pytest
import torch

from grpo_trainer.rollout.fast import selfcheck
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import TWO_GROUPS_OF_4, make_trainer, model_of_kind

SETTINGS = dict(**TWO_GROUPS_OF_4, max_completion_length=8)


class Compared:
    """Records each rollout of the trainer's backend next to `model.generate`'s on the same model and prompts."""

    def __init__(self, backend):
        self.backend, self.pairs = backend, []
        self.capabilities = backend.capabilities

    def generate(self, model, prompts, config, capture):
        out = self.backend.generate(model, prompts, config, capture)
        with torch.no_grad():
            self.pairs.append((out, generate_rollout(model, prompts, config)))
        return out


@pytest.mark.parametrize("window", [8, 4096])  # shorter than prompt + completion (9 + 8), and longer
def test_greedy_rollouts_of_a_sliding_window_model_equal_generates(tmp_path, tokenizer, toy_dataset, window):
    """Mistral reads `sliding_window` from its config, not from its attention modules, where the guard looked: the
    fast decoder ran full attention and every completion differed from generate's (TRL: all equal)."""
    model = model_of_kind("mistral", tokenizer, sliding_window=window, initializer_range=0.1)
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **SETTINGS, max_steps=1,
                           generation_kwargs={"do_sample": False})
    trainer.rollout_backend = compared = Compared(trainer.rollout_backend)
    trainer.train()
    (out, reference), = compared.pairs
    assert out.prompt_ids.shape[1] + out.completion_ids.shape[1] > 8  # the window cuts these rollouts short
    assert torch.equal(out.completion_ids, reference.completion_ids)
    assert torch.equal(out.completion_mask, reference.completion_mask)


def _forced(tokenizer):
    digits = tokenizer.convert_tokens_to_ids(list("123")) + [tokenizer.eos_token_id]

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor([digits] * input_ids.shape[0])], dim=1)

    return fake_generate


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_patched_generate_forces_the_completions_with_the_default_backend(tmp_path, tokenizer, toy_dataset,
                                                                             where):
    """TRL's tests force completions by patching `GenerationMixin.generate` or `trainer.model.generate`; the fast
    backend, which does not call generate, used to ignore both."""
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model_of_kind("qwen2", tokenizer), **SETTINGS,
                           max_steps=1)
    assert trainer.args.generation_backend == "fast"
    target = mock.patch("transformers.generation.utils.GenerationMixin.generate", side_effect=_forced(tokenizer)) \
        if where == "class" else mock.patch.object(trainer.model, "generate", side_effect=_forced(tokenizer))
    with target as patched:
        trainer.train()
    assert patched.call_count == 1
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] == 4 and logged["completions/clipped_ratio"] == 0


def test_nan_logits_stop_training_with_an_error_naming_the_model(tmp_path, tokenizer, toy_dataset):
    """NaN logits used to be sampled from for the whole rollout, then the loss was NaN and the non-finite guard
    stopped the run blaming rewards or the learning rate."""
    model = model_of_kind("qwen2", tokenizer)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = math.nan
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model, **SETTINGS, max_steps=1,
                           max_nonfinite_steps=0)
    with pytest.raises(RuntimeError, match="the model produced NaN/inf logits at completion token 0 in 8 of 8 rows"):
        trainer.train()


def test_the_decoders_self_check_runs_once_per_training_run(tmp_path, tokenizer, toy_dataset, monkeypatch):
    """Training changes weights in place and adds transformers' own hooks (hidden-state recording, input grads
    re-registered around each rollout): none of it is a reason to check the decoder again."""
    checked = []
    measure = selfcheck._measure
    monkeypatch.setattr(selfcheck, "_measure", lambda *args: checked.append(args[0]) or measure(*args))
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model_of_kind("qwen2", tokenizer), **SETTINGS,
                           max_steps=3)
    trainer.train()
    assert checked == [trainer.model] and trainer.state.global_step == 3
