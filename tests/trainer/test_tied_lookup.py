"""A tied embedding's lookup adding its rows into the LM head's gradient (`modeling.tied_embedding`) moves the
weights as the dense lookup does: one SGD step of a real training run (the toy model ties its embeddings), two
micro-batches accumulated, with a KL term and checkpointing."""

import contextlib

import torch

from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.modeling import forwards, tied_embedding
from tests.helpers import sgd_step_args, sgd_step_deltas


def test_a_step_with_the_tied_lookup_equals_the_dense_one(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "model"
    make_tiny_model(tokenizer, hidden_size=64, num_layers=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    handed = []  # per lookup backward: whether the head's gradient was there to add into
    take = tied_embedding.Link.take
    monkeypatch.setattr(tied_embedding.Link, "take", lambda link: handed.append(link._gradient is not None)
                        or take(link))
    args = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)
    tied = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "tied", **args))
    assert handed == [True, True]  # both micro-batches' lookups added into the head's gradient
    with monkeypatch.context() as patch:  # the reference: the lookup's own dense backward
        patch.setattr(forwards, "tied_lookup", lambda lm: contextlib.nullcontext())
        dense = sgd_step_deltas(path, tokenizer, sgd_step_args(tmp_path / "dense", **args))
    assert handed == [True, True]
    embedding = "model.embed_tokens.weight"
    assert dense[embedding].abs().max().item() > 1e-4  # the tied matrix moved
    for name in dense:
        torch.testing.assert_close(tied[name], dense[name], rtol=1e-4, atol=1e-6, msg=name)
