import torch

from tests.helpers import TWO_GROUPS_OF_4, make_trainer


def test_trains_and_changes_every_parameter(tmp_path, tiny_model, tokenizer, toy_dataset):
    before = {n: p.clone() for n, p in tiny_model.named_parameters()}
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=tiny_model, **TWO_GROUPS_OF_4,
                           max_completion_length=8)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, before[n]) for n, p in tiny_model.named_parameters())
