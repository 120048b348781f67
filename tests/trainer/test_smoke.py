import torch

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_reward


def test_trains_and_changes_every_parameter(tmp_path, tiny_model, tokenizer, toy_dataset):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, learning_rate=0.1, max_steps=2, report_to="none", save_strategy="no")
    before = {n: p.clone() for n, p in tiny_model.named_parameters()}
    trainer = GRPOTrainer(tiny_model, copy_digits_reward, args=args, train_dataset=toy_dataset,
                          processing_class=tokenizer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, before[n]) for n, p in tiny_model.named_parameters())
