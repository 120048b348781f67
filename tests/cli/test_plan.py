"""`grpo-train plan`: the itemised plan and verdict from a model's config, offline, without reading weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_trainer.cli import entry
from grpo_trainer.cli.toy import make_tiny_model
from tests.helpers import write_remote_code_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config_dir(tmp_path, tokenizer):
    """A model directory holding only config.json and the tokenizer: no weights to read."""
    path = tmp_path / "model"
    model = make_tiny_model(tokenizer)
    model.config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert not list(path.glob("*.safetensors"))
    return path


def plan(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        entry.main(["plan", *argv])
    return exited.value.code, capsys.readouterr()


def test_plan_from_a_config_directory(config_dir, capsys, monkeypatch):
    monkeypatch.delenv("GRPO_TRAINER_DEVICE_MEMORY", raising=False)
    code, out = plan(["--model_name_or_path", str(config_dir), "--dataset_name", "builtin:copy_digits",
                      "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "32",
                      "--beta", "0.04"], capsys)
    assert code == 0, out.err
    for text in ("weights", "reference model", "optimizer state", "KV cache", "activations", "opt step",
                 "total (resident memory)", "verdict: fits"):
        assert text in out.out
    # the prompt length: the longest of the dataset's first prompts, tokenised as the rollout does
    from transformers import AutoTokenizer

    from grpo_trainer.cli.toy import copy_digits_dataset
    from grpo_trainer.rollout.prompts import tokenize_prompts

    rows = copy_digits_dataset(num_prompts=512).select(range(256))
    saved = AutoTokenizer.from_pretrained(config_dir)  # what the trainer loads for a model given by path
    longest = tokenize_prompts(saved, list(rows["prompt"]), None).ids.shape[1]
    assert f"prompt {longest} + completion 32 tokens" in out.out


def test_the_same_yaml_as_training_and_a_device_that_is_too_small(config_dir, tmp_path, capsys):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"model_name_or_path: {config_dir}\nper_device_train_batch_size: 8\nnum_generations: 4\n"
                      "max_completion_length: 64\nmax_prompt_length: 16\n")
    code, out = plan(["--config", str(recipe), "--device_memory", "100MiB"], capsys)
    assert code == 1
    assert "DOES NOT FIT" in out.out and "it would run out of memory" in out.out
    assert "prompt 16 + completion 64 tokens" in out.out  # no dataset: max_prompt_length


def test_plan_for_a_gpu_from_a_machine_without_one(config_dir, capsys):
    code, out = plan(["--model_name_or_path", str(config_dir), "--max_prompt_length", "32", "--bf16", "True",
                      "--device", "cuda", "--device_memory", "80GiB", "--use_vllm", "True"], capsys)
    assert code == 0, out.err
    assert "on cuda" in out.out and "autocast bfloat16" in out.out and "total on the GPU (allocated)" in out.out
    assert "vLLM engine" in out.out and "24.00" in out.out  # 0.3 of 80 GiB


def test_bad_input_is_status_2(capsys):
    code, out = plan(["--model_name_or_path", "./no/such/model"], capsys)
    assert code == 2 and "does not exist" in out.err


def test_a_hub_id_is_read_from_the_cache_offline(tmp_path, tokenizer):
    """`org/name` resolves through the Hub cache like any from_pretrained (offline here: a cache written by hand)."""
    snapshot = tmp_path / "hub" / "models--someorg--tiny" / "snapshots" / ("0" * 40)
    model = make_tiny_model(tokenizer)
    model.config.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (tmp_path / "hub" / "models--someorg--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--tiny" / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "GRPO_TRAINER_DEVICE_MEMORY": "8GiB"}
    proc = subprocess.run([sys.executable, "-m", "grpo_trainer.cli", "plan", "--model_name_or_path", "someorg/tiny",
                           "--max_prompt_length", "16"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Memory plan for someorg/tiny" in proc.stdout and "verdict: fits" in proc.stdout


def test_plan_reports_the_longest_completion_that_fits(config_dir, capsys):
    """The printed longest max_completion_length is the plan's own boundary: planned again at that length the run
    fits (status 0), one token longer it does not (status 1); checkpointing off, so it is listed as reaching longer,
    as is LoRA (the run has no adapter); the model's context (512 positions) is named since the answer passes it."""
    import re

    common = ["--model_name_or_path", str(config_dir), "--max_prompt_length", "16", "--per_device_train_batch_size",
              "8", "--num_generations", "4", "--gradient_checkpointing", "False", "--device_memory", "1GiB"]
    code, out = plan([*common, "--max_completion_length", "64"], capsys)
    assert code == 0, out.err
    found = re.search(r"Longest max_completion_length that fits 1.00 GiB: ([\d,]+) tokens \(prompt 16 tokens; "
                      r"this run asks 64;", out.out)
    assert found, out.out
    longest = int(found.group(1).replace(",", ""))
    assert "  gradient_checkpointing=True: " in out.out and "(same objective)" in out.out
    assert "use_peft=True" in out.out and "trains an adapter, not every weight" in out.out
    assert "The model's context is 512 positions: at most 496 completion tokens" in out.out
    code, out = plan([*common, "--max_completion_length", str(longest)], capsys)
    assert code == 0 and "verdict: fits" in out.out
    code, out = plan([*common, "--max_completion_length", str(longest + 1)], capsys)
    assert code == 1 and "DOES NOT FIT" in out.out


# ------------------------------------------------------------------- a Hub id the plan cannot read (issue 38)


def test_a_hub_id_not_in_the_cache_offline_names_the_model_and_the_download(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = plan(["--model_name_or_path", "no-such-org/no-such-model", "--max_prompt_length", "16"], capsys)
    assert code == 2
    assert out.err.count("\n") == 1 and out.err.startswith("grpo-train plan: error: model 'no-such-org/no-such-model'")
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in out.err
    assert "`hf download no-such-org/no-such-model`" in out.err


def hub_answers(monkeypatch, error_class, status: int) -> None:
    """The Hub's answer `error_class` (huggingface_hub's own) raised where transformers downloads (no network here);
    everything above it is the real code path."""
    import httpx2
    from transformers.utils import hub

    def answer(repo_id, filename, **kwargs):
        url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
        response = httpx2.Response(status, request=httpx2.Request("GET", url))
        raise error_class(f"{status} Client Error for url {url}.", response=response)

    monkeypatch.setattr(hub, "hf_hub_download", answer)


def test_a_gated_model_names_the_model_and_the_login(capsys, monkeypatch):
    from huggingface_hub.errors import GatedRepoError

    hub_answers(monkeypatch, GatedRepoError, 403)
    code, out = plan(["--model_name_or_path", "gated-org/gated-model", "--max_prompt_length", "16"], capsys)
    assert code == 2
    assert out.err.count("\n") == 1
    assert "model 'gated-org/gated-model' is gated on the Hub" in out.err
    assert "https://huggingface.co/gated-org/gated-model" in out.err and "`hf auth login`" in out.err


def test_an_id_the_hub_does_not_have_names_the_model_and_what_to_check(capsys, monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    hub_answers(monkeypatch, RepositoryNotFoundError, 404)
    code, out = plan(["--model_name_or_path", "some-org/typo-model", "--max_prompt_length", "16"], capsys)
    assert code == 2
    assert out.err.count("\n") == 1
    assert "model 'some-org/typo-model' is neither a local directory nor a model on the Hub: check the id" in out.err


def test_remote_code_without_trust_names_the_model_and_the_flag(tmp_path, tokenizer, capsys):
    folder = write_remote_code_model(tmp_path / "remote", tokenizer)
    capsys.readouterr()  # the writer's progress bars
    code, out = plan(["--model_name_or_path", folder, "--max_prompt_length", "16"], capsys)
    assert code == 2
    assert out.err.count("\n") == 1 and f"{folder!r} contains custom code" in out.err
    assert "`--trust_remote_code True`" in out.err
    # with the flag, the same directory plans (its config is read through its own code)
    code, out = plan(["--model_name_or_path", folder, "--max_prompt_length", "16", "--trust_remote_code", "True"],
                     capsys)
    assert code in (0, 1), out.err
    assert f"Memory plan for {folder}" in out.out


def test_device_memory_is_the_budget_of_that_call_only(config_dir, capsys, monkeypatch):
    # `grpo-train plan --device_memory` called in a process (a test, a notebook) must not leave its budget behind:
    # a later trainer's memory check in the same process would plan against it (a leaked 1 GiB once stopped an
    # unrelated run in the suite)
    import os

    monkeypatch.delenv("GRPO_TRAINER_DEVICE_MEMORY", raising=False)
    code, out = plan(["--model_name_or_path", str(config_dir), "--max_prompt_length", "16", "--device_memory",
                      "1GiB"], capsys)
    assert code in (0, 1) and "of 1.00 GiB" in out.out
    assert "GRPO_TRAINER_DEVICE_MEMORY" not in os.environ
    monkeypatch.setenv("GRPO_TRAINER_DEVICE_MEMORY", "7GiB")
    plan(["--model_name_or_path", str(config_dir), "--max_prompt_length", "16", "--device_memory", "1GiB"], capsys)
    assert os.environ["GRPO_TRAINER_DEVICE_MEMORY"] == "7GiB"
