"""LoRA / QLoRA: adapter-only training, the adapter-disabled reference, saving, reloading, merging, pushing.

One LoRA run (2 steps, beta > 0, gradient checkpointing, a checkpoint at step 2) is shared by most tests; the
others build their own trainer. Everything is offline: the Hub is replaced at the network boundary only
(`HfApi.create_repo` / `HfApi.upload_folder`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import warnings

import pytest
import torch
import transformers.trainer
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.utils import filter_repo_objects
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel, TrainerCallback

from grpo_trainer import GRPOConfig, GRPOTrainer
from grpo_trainer.cli.toy import copy_digits_dataset, copy_digits_reward, make_tiny_model
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.runtime import models

BASE_ID = "org/tiny-base"  # pretend Hub id: the card must name it as the base model
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
SAVED_FILES = ADAPTER_FILES | TOKENIZER_FILES | {"README.md", "training_args.bin"}


def lora() -> LoraConfig:
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def short_reward(completions: list, **kwargs) -> list[float]:
    return [-len(c) / 8 for c in completions]


def base_model(tokenizer) -> PreTrainedModel:
    """The tiny base model (seed 0: every call returns the same weights), posing as the Hub model BASE_ID."""
    model = make_tiny_model(tokenizer)
    model.name_or_path = model.config._name_or_path = BASE_ID
    return model


def config(output_dir, **overrides) -> GRPOConfig:
    defaults = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
                "learning_rate": 0.1, "max_steps": 2, "logging_steps": 1, "report_to": "none", "save_strategy": "no"}
    return GRPOConfig(output_dir=str(output_dir), **{**defaults, **overrides})


def sequence_logps(model, tokenizer) -> torch.Tensor:
    """Log-probs of a fixed completion after each of three prompts: `[3, 5]`."""
    prompts = tokenizer(["copy 123:", "copy 9:", "copy 4567:"], padding=True, return_tensors="pt")
    completion = tokenizer(["12399", "9<eos>abc", "45 67"], return_tensors="pt").input_ids
    input_ids = torch.cat([prompts.input_ids, completion], dim=1)
    mask = torch.cat([prompts.attention_mask, torch.ones_like(completion)], dim=1)
    model.eval()
    with torch.no_grad():
        logps = completion_logprobs(model, input_ids, mask, completion.shape[1], 1.0, 1024, False).logps
    return logps


@pytest.fixture(scope="module")
def run(tokenizer, tmp_path_factory):
    """A 2-step LoRA run with beta > 0, gradient checkpointing, RLOO, two weighted rewards and a checkpoint."""
    out = tmp_path_factory.mktemp("lora_run")
    model = base_model(tokenizer)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = config(out, beta=0.1, gradient_checkpointing=True, advantage_estimator="rloo", loss_type="grpo",
                  reward_weights=[1.0, 0.5], save_strategy="steps", save_steps=2)
    trainer = GRPOTrainer(model, [copy_digits_reward, short_reward], args=args,
                          train_dataset=copy_digits_dataset(32), processing_class=tokenizer, peft_config=lora())
    adapter_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    trainer.save_model()
    return trainer, base_before, adapter_before, out


# --------------------------------------------------------------------------------------------- training


def test_only_the_adapter_trains_and_base_weights_stay_bit_identical(run):
    trainer, base_before, adapter_before, _ = run
    assert isinstance(trainer.model, PeftModel)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    for name, p in trainer.model.named_parameters():
        if name in trainable:
            assert not torch.equal(p, adapter_before[name]), f"adapter parameter {name} did not change"
    base_after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
                  for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert base_after.keys() == base_before.keys()
    for name, before in base_before.items():
        after = base_after[name]
        assert torch.equal(after, before), f"base parameter {name} changed"


def test_gradient_checkpointing_was_active_in_the_lora_run(run):
    # The shared run trained with gradient_checkpointing=True: the adapter changed (test above) while the
    # decoder layers were checkpointed.
    trainer = run[0]
    layers = trainer.model.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers)


def test_reference_is_the_policy_with_its_adapter_disabled(run, tokenizer):
    trainer = run[0]
    assert trainer.ref_model is None  # no second model in memory
    # Step 1: lora_B starts at 0, so policy == base and k3 KL is exactly 0. Step 2: the adapter has moved the
    # policy, so KL to the reference is > 0; had the reference been the adapted policy it would still be 0.
    kls = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kls[0] == 0.0 and kls[1] > 0.0
    # And the reference log-probs are exactly those of the untouched base model.
    with models.reference_context(trainer.model):
        reference = sequence_logps(trainer.model, tokenizer)
    torch.testing.assert_close(reference, sequence_logps(base_model(tokenizer), tokenizer), rtol=0, atol=1e-6)


def test_a_ready_peft_model_trains_only_its_adapter_with_the_disabled_adapter_as_reference(tmp_path, tokenizer):
    model = get_peft_model(base_model(tokenizer), lora())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = config(tmp_path, beta=0.1, gradient_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fresh adapter must not trigger the "trained adapter" warning
        trainer = GRPOTrainer(model, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(32),
                              processing_class=tokenizer)
    assert trainer.ref_model is None
    trainer.train()
    for name, p in model.named_parameters():
        if name in adapter:
            assert not torch.equal(p, adapter[name]), name
        else:
            assert torch.equal(p, base[name]), name


def test_an_already_trained_adapter_with_beta_warns_that_the_reference_is_the_base(tmp_path, tokenizer):
    model = get_peft_model(base_model(tokenizer), lora())
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(0.01)
    with pytest.warns(UserWarning, match="already trained"):
        GRPOTrainer(model, copy_digits_reward, args=config(tmp_path, beta=0.1),
                    train_dataset=copy_digits_dataset(8), processing_class=tokenizer)


def test_an_adapter_on_lm_head_is_rejected(tmp_path, tiny_model, tokenizer):
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="adapter on lm_head"):
        GRPOTrainer(tiny_model, copy_digits_reward, args=config(tmp_path), train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer, peft_config=peft_config)


@pytest.mark.parametrize("wrapped", [False, True])
def test_prompt_learning_adapters_are_refused(tmp_path, tokenizer, wrapped):
    """Prompt tuning prepends virtual tokens in PeftModel.forward, which the rollout backends and the log-prob
    forward bypass: refused by name (TRL 1.16 accepts it; its older releases refused it with the Liger loss)."""
    from peft import PromptTuningConfig, TaskType

    prompt_tuning = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    model = get_peft_model(base_model(tokenizer), prompt_tuning) if wrapped else base_model(tokenizer)
    with pytest.raises(ValueError, match="PromptTuningConfig is a prompt-learning PEFT method"):
        GRPOTrainer(model, copy_digits_reward, args=config(tmp_path), train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer, peft_config=None if wrapped else prompt_tuning)


def test_modules_to_save_lm_head_trains_a_copy_of_the_head(tmp_path, tokenizer):
    """TRL 1.16 accepts `modules_to_save=["lm_head"]`: the head is a fully trained copy (not an adapter), which the
    log-probs reach through the wrapper's forward; the KL reference (adapter disabled) keeps the original head."""
    model = base_model(tokenizer)
    original_head = model.lm_head.weight.detach().clone()
    peft_config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model, copy_digits_reward, args=config(tmp_path, beta=0.1, learning_rate=0.1),
                          train_dataset=copy_digits_dataset(8), processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    trained = trainer.model.get_parameter("base_model.model.lm_head.modules_to_save.default.weight")
    assert not torch.equal(trained, original_head)
    torch.testing.assert_close(trainer.model.get_parameter("base_model.model.lm_head.original_module.weight"),
                               original_head, atol=0, rtol=0)


# ----------------------------------------------------------------------------------- saving + reloading


def test_save_model_and_checkpoints_write_the_adapter_tokenizer_and_card_not_the_full_model(run):
    out = run[3]
    assert set(os.listdir(out)) - {"checkpoint-2"} == SAVED_FILES
    checkpoint = set(os.listdir(out / "checkpoint-2"))
    assert SAVED_FILES <= checkpoint
    assert not checkpoint & {"model.safetensors", "config.json", "pytorch_model.bin"}
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)  # adapter weights only
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE_ID


def test_model_card_names_base_library_tags_settings_and_rewards(run):
    trainer, out = run[0], run[3]
    for folder in (out, out / "checkpoint-2"):
        card = ModelCard.load(folder / "README.md")
        assert card.data.base_model == BASE_ID
        assert card.data.library_name == "peft"  # the Hub shows PEFT loading code and links the adapter to its base
        assert {"grpo_trainer", "grpo", "lora", "peft"} <= set(card.data.tags)
        for row in ("| `advantage_estimator` | `rloo` |", "| `loss_type` | `grpo` |", "| `beta` | `0.1` |",
                    "| `num_generations` | `4` |", "| `r` | `4` |", "| `target_modules` | `['q_proj', 'v_proj']` |"):
            assert row in card.text, row
        assert "- `copy_digits_reward` (weight 1)" in card.text
        assert "- `short_reward` (weight 0.5)" in card.text
        assert f'AutoModelForCausalLM.from_pretrained("{BASE_ID}")' in card.text
    assert trainer.args.output_dir == str(out)


def test_reloaded_adapter_reproduces_the_trained_policy(run, tokenizer):
    trainer, out = run[0], run[3]
    trained = sequence_logps(trainer.model, tokenizer)
    reloaded = PeftModel.from_pretrained(base_model(tokenizer), str(out))
    torch.testing.assert_close(sequence_logps(reloaded, tokenizer), trained, rtol=0, atol=1e-6)
    # The comparison is not vacuous: the adapter moved the log-probs away from the base model's.
    assert (trained - sequence_logps(base_model(tokenizer), tokenizer)).abs().max() > 1e-3


def test_resume_from_an_adapter_checkpoint_restores_the_adapter(run, tokenizer, tmp_path):
    trainer, out = run[0], run[3]  # checkpoint-2 is the run's final state

    class Snapshot(TrainerCallback):  # the weights right after the checkpoint is loaded, before any step
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    snapshot = Snapshot()
    resumed = GRPOTrainer(base_model(tokenizer), copy_digits_reward, args=config(tmp_path, max_steps=3),
                          train_dataset=copy_digits_dataset(32), processing_class=tokenizer, peft_config=lora(),
                          callbacks=[snapshot])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 3
    trained = dict(trainer.model.named_parameters())
    assert snapshot.weights.keys() == trained.keys()
    assert all(torch.equal(p, trained[n]) for n, p in snapshot.weights.items())


def test_save_merged_model_writes_a_full_model_with_the_same_logprobs(run, tokenizer, tmp_path):
    trainer = run[0]
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.save_merged_model(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "README.md"} | TOKENIZER_FILES <= files
    assert not files & ADAPTER_FILES
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "transformers" and card.data.base_model == BASE_ID
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # W + s*B@A folded into one matrix rounds differently from W@x + s*B@(A@x) in fp32: agreement to ~1e-6.
    torch.testing.assert_close(sequence_logps(merged, tokenizer), sequence_logps(trainer.model, tokenizer),
                               rtol=0, atol=1e-5)
    # The merge happened on a copy: the trainer's adapter model is untouched.
    assert isinstance(trainer.model, PeftModel)
    assert all(torch.equal(p, lora_before[n]) for n, p in trainer.model.named_parameters())


def test_save_merged_model_without_an_adapter_is_rejected(tmp_path, tiny_model, tokenizer):
    trainer = GRPOTrainer(tiny_model, copy_digits_reward, args=config(tmp_path),
                          train_dataset=copy_digits_dataset(8), processing_class=tokenizer)
    with pytest.raises(ValueError, match="no adapter"):
        trainer.save_merged_model(str(tmp_path / "merged"))


# ------------------------------------------------------------------------------------------------- Hub


@pytest.fixture
def fake_hub(monkeypatch):
    """Stand-in for the network calls only: records what `upload_folder` would send (after ignore_patterns)."""
    uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, run_as_future=False,
                      **kwargs):
        paths = [os.path.relpath(os.path.join(root, f), folder_path)
                 for root, _, names in os.walk(folder_path) for f in names]
        files = set(filter_repo_objects(paths, ignore_patterns=ignore_patterns))
        readme = os.path.join(folder_path, "README.md")
        uploads.append({"repo_id": repo_id, "path_in_repo": path_in_repo, "files": files,
                        "card": ModelCard.load(readme) if os.path.exists(readme) else None})
        if run_as_future:
            future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return None

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    # transformers < 5.10 calls huggingface_hub's module-level functions, methods of an HfApi made at import
    for name, fake in (("create_repo", create_repo), ("upload_folder", upload_folder)):
        if hasattr(transformers.trainer, name):
            monkeypatch.setattr(transformers.trainer, name, functools.partial(fake, None))
    return uploads


def test_push_to_hub_uploads_exactly_the_adapter_tokenizer_and_card(tmp_path, tokenizer, fake_hub):
    args = config(tmp_path, max_steps=1, push_to_hub=True, hub_model_id="me/tiny-grpo-lora", save_strategy="steps",
                  save_steps=1, hub_strategy="every_save", gradient_checkpointing=False)
    trainer = GRPOTrainer(base_model(tokenizer), copy_digits_reward, args=args,
                          train_dataset=copy_digits_dataset(16), processing_class=tokenizer, peft_config=lora())
    trainer.train()  # checkpoint-1 is saved and pushed
    trainer.push_to_hub()
    assert len(fake_hub) == 2
    checkpoint_push, final_push = fake_hub
    for push in (checkpoint_push, final_push):
        assert push["repo_id"] == "me/tiny-grpo-lora" and push["path_in_repo"] is None
        assert push["files"] == SAVED_FILES  # no full weights, no checkpoint folder, nothing else
        assert push["card"].data.library_name == "peft" and push["card"].data.base_model == BASE_ID
        assert push["card"].data.model_name == "tiny-grpo-lora"
        assert 'PeftModel.from_pretrained(base, "me/tiny-grpo-lora")' in push["card"].text


# ----------------------------------------------------------------------------------------------- QLoRA


@pytest.fixture
def saved_base(tmp_path, tokenizer):
    folder = tmp_path / "tiny-base"
    make_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Fail the test if any model weights are loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the quantization check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_qlora_without_cuda_fails_before_loading_weights(tmp_path, saved_base, tokenizer, no_weight_loading):
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        GRPOTrainer(saved_base, copy_digits_reward, args=config(tmp_path), train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer, peft_config=lora(),
                    quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    # The same check when the config arrives through model_init_kwargs.
    args = config(tmp_path, model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        GRPOTrainer(saved_base, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer, peft_config=lora())


def test_quantization_config_with_an_already_loaded_model_is_rejected(tmp_path, tiny_model, tokenizer):
    with pytest.raises(ValueError, match="already loaded"):
        GRPOTrainer(tiny_model, copy_digits_reward, args=config(tmp_path), train_dataset=copy_digits_dataset(8),
                    processing_class=tokenizer, peft_config=lora(),
                    quantization_config=BitsAndBytesConfig(load_in_4bit=True))


@pytest.mark.gpu
def test_qlora_trains_the_adapter_on_a_4bit_base(tmp_path, saved_base, tokenizer):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs the bitsandbytes package (pip install bitsandbytes)")
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    args = config(tmp_path, bf16=True, gradient_checkpointing=True, beta=0.1)
    trainer = GRPOTrainer(saved_base, copy_digits_reward, args=args, train_dataset=copy_digits_dataset(32),
                          processing_class=tokenizer, peft_config=lora(), quantization_config=quantization)
    assert trainer.model.get_base_model().is_loaded_in_4bit
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, p in trainer.model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == ("lora_" in name), name
    trainer.save_model()
    assert ADAPTER_FILES <= set(os.listdir(tmp_path))
