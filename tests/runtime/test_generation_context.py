"""The model the rollout gets: unwrapped, activation checkpointing paused and restored exactly, no hooks leaked."""

import pytest

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.rollout import generate as generate_module
from grpo_trainer.runtime import compat
from grpo_trainer.runtime.distributed import checkpointing_paused
from tests.helpers import TWO_GROUPS_OF_4, make_trainer


def _flags(model) -> list[bool]:
    return [layer.gradient_checkpointing for layer in model.get_decoder().layers]


def test_checkpointing_paused_restores_the_flags_even_after_an_error(tokenizer):
    model = make_tiny_model(tokenizer)
    compat.enable_checkpointing(model)
    function = model.get_decoder().layers[0]._gradient_checkpointing_func
    with pytest.raises(RuntimeError, match="inside"):
        with checkpointing_paused(model):
            assert _flags(model) == [False, False] and not compat.checkpointing_is_on(model)
            raise RuntimeError("inside")
    assert _flags(model) == [True, True] and model.get_decoder().layers[0]._gradient_checkpointing_func is function
    plain = make_tiny_model(tokenizer)  # checkpointing off: nothing to pause, nothing turned on afterwards
    with checkpointing_paused(plain):
        pass
    assert _flags(plain) == [False, False]


def test_rounds_generate_without_checkpointing_and_add_no_hooks(tmp_path, tokenizer, toy_dataset, monkeypatch):
    """transformers' disable/enable pair adds an input-grad hook to the embedding on every enable; four rounds
    through it left five hooks. Here the embedding keeps the one hook checkpointing set up, and every round
    generated with the layers' checkpointing off."""
    seen = []
    original = generate_module.generate_rollout
    monkeypatch.setattr(generate_module, "generate_rollout",
                        lambda model, *a: seen.append(_flags(model)) or original(model, *a))
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, **TWO_GROUPS_OF_4, max_completion_length=4, max_steps=4,
                           generation_backend="generate")
    trainer.train()
    assert seen == [[False, False]] * 4
    assert _flags(trainer.model) == [True, True]
    assert len(trainer.model.get_input_embeddings()._forward_hooks) == 1
