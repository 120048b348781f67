"""What differs between transformers releases (`runtime/compat.py`), checked on the installed release: CI runs this
suite on the newest release and on setup.cfg's floor (`scripts/test_floor.sh`), so each branch is exercised."""

import configparser
import math
from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from transformers import TrainingArguments

from grpo_trainer import GRPOConfig
from grpo_trainer.cli.toy import make_tiny_model
from grpo_trainer.runtime import compat
from tests.helpers import make_trainer, varied_reward

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")
NEWER_NAMES = "activation_checkpointing" in TrainingArguments.__dataclass_fields__  # transformers >= 5.23


def _setup_cfg_floor() -> str:
    parser = configparser.ConfigParser()
    parser.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    requirement = next(line for line in parser["options"]["install_requires"].split("\n")
                       if line.strip().startswith("transformers"))
    return requirement.split(">=")[1].split(",")[0].strip()


def test_the_floor_is_setup_cfgs_and_the_installed_release_is_at_least_it():
    assert Version(compat.FLOOR) == Version(_setup_cfg_floor())
    assert Version(transformers.__version__) >= Version(compat.FLOOR)


# ------------------------------------------------------------------------------- activation checkpointing


def test_both_checkpointing_names_are_fields_and_hold_one_value():
    assert {"activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing",
            "gradient_checkpointing_kwargs"} <= set(GRPOConfig.__dataclass_fields__)
    assert bool(compat.BACKPORTED_FIELDS) is not NEWER_NAMES  # declared here exactly where transformers lacks them
    # The command line passes kwargs as JSON: parsed once, under both names.
    config = GRPOConfig(**BASE, activation_checkpointing_kwargs='{"use_reentrant": false}')
    assert config.activation_checkpointing_kwargs == config.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert config.activation_checkpointing is config.gradient_checkpointing is True


def test_checkpointing_options_of_newer_releases_are_refused_by_name_on_older_ones():
    kwargs = {"every_n_layers": 2}
    if NEWER_NAMES:
        assert GRPOConfig(**BASE, activation_checkpointing_kwargs=kwargs).activation_checkpointing_kwargs == kwargs
    else:  # torch's checkpoint would fail on the unknown key at the first training step
        with pytest.raises(ValueError, match=r"\['every_n_layers'\] need transformers >= 5.23"):
            GRPOConfig(**BASE, activation_checkpointing_kwargs=kwargs)


def test_checkpointing_toggles_the_models_layers(tokenizer):
    lm = make_tiny_model(tokenizer)
    assert not compat.checkpointing_is_on(lm)
    compat.enable_checkpointing(lm)
    assert compat.checkpointing_is_on(lm) and all(layer.gradient_checkpointing for layer in lm.model.layers)
    compat.disable_checkpointing(lm)
    assert not compat.checkpointing_is_on(lm) and not any(layer.gradient_checkpointing for layer in lm.model.layers)


def test_the_trainer_turns_checkpointing_on_by_default_and_off_when_asked(tmp_path, tokenizer, toy_dataset):
    def run(**overrides):
        lm = make_tiny_model(tokenizer)
        make_trainer(tmp_path, tokenizer, toy_dataset, varied_reward, lm, max_completion_length=4, max_steps=1,
                     **overrides).train()
        return compat.checkpointing_is_on(lm)

    assert run() is True
    assert run(activation_checkpointing=False) is False


# ------------------------------------------------------------------------------ gradient-accumulation scaling


def _first_grad_norm(tmp_path, tokenizer, dataset, accumulation: int) -> float:
    """grad_norm of the first optimizer step over one round of 8 completions, split into `accumulation`
    micro-batches."""
    trainer = make_trainer(tmp_path, tokenizer, dataset, varied_reward, per_device_train_batch_size=8 // accumulation,
                           gradient_accumulation_steps=accumulation, loss_type="dapo", max_steps=1)
    trainer.train()
    return next(entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry)


def test_gradient_accumulation_scales_the_gradient_once(tmp_path, tokenizer, toy_dataset):
    """dapo's loss is the token mean over the whole accumulation window, whatever its split (DAPO, section 3.3), so
    one round of 8 completions gives the same gradient as one micro-batch of 8 or as 2 or 4 micro-batches
    accumulated. A loss divided by the micro-batch count again (what `Trainer.training_step` does unless
    `loss_is_scaled_for_ga` is set) gives 1/2 and 1/4 of it, one never scaled 2 and 4 times it."""
    whole = _first_grad_norm(tmp_path / "1", tokenizer, toy_dataset, accumulation=1)
    assert whole > 0
    for accumulation in (2, 4):
        split = _first_grad_norm(tmp_path / str(accumulation), tokenizer, toy_dataset, accumulation)
        assert math.isclose(split, whole, rel_tol=1e-4), (accumulation, split, whole)
