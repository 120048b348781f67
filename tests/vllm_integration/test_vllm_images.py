"""Prompts with images through real vLLM, colocated and on a server, as TRL 1.16 sends them: the engine expands
each image placeholder itself into the processor's very tokens, its log-probs of the completions are the trainer's
(so its image features are), and the weight-sync check passes on image rows. Idefics3 is the family vLLM's CPU
build loads here; families whose vLLM code needs torchvision (absent from this CPU environment) are refused by name,
and a family whose image prompts cannot be rebuilt falls back to model.generate for its image rounds."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from grpo_trainer import GRPOTrainer
from grpo_trainer.data.images import attach_images
from grpo_trainer.rollout import backend as backends
from grpo_trainer.rollout import multimodal
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from grpo_trainer.rollout.settings import make_generation_config
from grpo_trainer.rollout.vllm import checks
from tests.matrix.cell_run import VLLM_VLM_FAMILY
from tests.toy_vlm import make_tiny_vlm
from tests.trainer.test_vlm import image_dataset, varied_reward
from tests.vllm_integration.test_vllm_colocate import LOGP_ATOL
from tests.vllm_integration.vllm_helpers import (
    trainer_args,
    vllm_tiny_vlm,
)

FAMILY = VLLM_VLM_FAMILY


def _trainer(tmp_path, **overrides):
    model, processor = vllm_tiny_vlm(FAMILY)
    args = trainer_args(tmp_path, **{"per_device_train_batch_size": 4, "num_generations": 2,
                                     "max_completion_length": 6, "vllm_sync_check_interval": 1, **overrides})
    return GRPOTrainer(model, varied_reward, args=args, train_dataset=image_dataset(rows=8, images_per_row=[1, 2]),
                       processing_class=processor)


def _assert_vllm_sampled_the_image_rounds(trainer):
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == trainer.args.max_steps
    # The weight-sync check after every push scores image rows' completions in vLLM (raw log-probs, the images
    # processed by vLLM) and in the trainer (the processor's pixel values): float32 on both sides, they agree to
    # float error, so vLLM's image features are the trainer's
    schedule = trainer.rollout_backend.schedule
    assert schedule.checks == trainer.args.max_steps and all(gap < LOGP_ATOL for gap, _ in schedule.gaps), \
        schedule.gaps
    # vLLM sampled the rounds (its log-probs fed the correction). Its sampled distribution excludes the image token
    # (logit_bias), the trainer's does not: they differ by log(1 - p(image token)) at most, under 0.1 here
    assert all(h["sampling/sampling_logp_difference/max"] < 0.1 for h in steps), steps


def test_colocated_vllm_samples_image_rounds(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.train()
    _assert_vllm_sampled_the_image_rounds(trainer)


def test_greedy_image_completions_equal_generates(tmp_path):
    trainer = _trainer(tmp_path)
    rows = image_dataset(rows=4, images_per_row=[1, 2, 0, 1])
    # each prompt twice in a row, as a round repeats it G times: greedy decoding sends one request per row
    prompts = [row["prompt"] for row in rows for _ in range(2)]
    images = [row["images"] for row in rows for _ in range(2)]
    batch = tokenize_prompts(trainer.processing_class, attach_images(prompts, images), None)
    assert multimodal.image_placeholder(trainer.processing_class) == "<image>"
    config = make_generation_config(trainer.args, trainer.model.generation_config, trainer._tokenizer, 6)
    config.do_sample = False
    backend = trainer.rollout_backend
    backend.sync_weights(trainer.accelerator.unwrap_model(trainer.model), 0)
    assert backends.serving(backend, batch) is backend
    out = backend.generate(trainer.model, batch, config)
    reference = generate_rollout(trainer.model, batch, config)
    assert torch.equal(out.completion_ids, reference.completion_ids)
    assert len({tuple(r.tolist()) for r in out.completion_ids}) > 1  # the images make the completions differ


def test_a_vllm_server_samples_image_rounds(tmp_path, vlm_server):
    from transformers import AutoModelForImageTextToText

    url, folder = vlm_server
    _, processor = vllm_tiny_vlm(FAMILY)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    args = trainer_args(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                        vllm_sync_check_interval=1, max_steps=2, vllm_mode="server", vllm_server_base_url=url,
                        vllm_server_timeout=30)
    trainer = GRPOTrainer(model, varied_reward, args=args, processing_class=processor,
                          train_dataset=image_dataset(rows=8, images_per_row=[1, 2]))
    trainer.train()
    _assert_vllm_sampled_the_image_rounds(trainer)


def _loads_here(family: str) -> bool:
    model, _ = make_tiny_vlm(family)
    return checks.unloadable_architecture([type(model).__name__]) is None


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_5", "gemma3", "llava"])
def test_a_family_vllm_cannot_load_here_is_refused_by_name(tmp_path, family):
    model, processor = make_tiny_vlm(family)
    architecture = type(model).__name__
    module = importlib.import_module("vllm.model_executor.models.registry")._VLLM_MODELS[architecture][0]
    try:
        importlib.import_module(f"vllm.model_executor.models.{module}")
        loadable = True
    except Exception:  # noqa: BLE001
        loadable = False
    assert loadable == _loads_here(family)
    if loadable:  # on an installation with torchvision's CPU build: nothing to refuse
        return
    with pytest.raises(ValueError, match=rf"vLLM cannot load this model on this installation \({architecture}: "
                                         r".*so use_vllm=True cannot serve it"):
        GRPOTrainer(model, varied_reward, args=trainer_args(tmp_path), train_dataset=image_dataset(rows=8),
                    processing_class=processor)


def test_a_family_whose_image_prompts_cannot_be_rebuilt_falls_back_to_generate(tmp_path, monkeypatch, caplog):
    def cannot(*args):
        raise ValueError("the processor's 4 tokens for image 0 are not in the prompt as it tokenised it")

    monkeypatch.setattr(multimodal, "unexpanded_ids", cannot)
    backends._told_about_images.discard("vllm")
    trainer = _trainer(tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.rollout.backend"):
        trainer.train()
    assert [r.message for r in caplog.records if r.name == "grpo_trainer.rollout.backend"] == [
        "vLLM cannot be given this idefics3 model's image prompts (the processor's 4 tokens for image 0 are not in "
        "the prompt as it tokenised it); rounds with images run on model.generate, text-only rounds on vLLM."]
    assert "sampling/sampling_logp_difference/max" not in trainer.state.log_history[0]  # generate sampled it
