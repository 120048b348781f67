"""Drop-in compatibility: a training script written the way TRL's documentation writes one for
`trl.GRPOTrainer` runs unchanged after swapping the import line — and also runs under TRL itself, which proves
the script really is a TRL script."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from tests.helpers import REPO

SCRIPT = textwrap.dedent('''
    import json, sys
    from datasets import load_dataset
    {import_line}

    model_dir, data_file, out_dir = sys.argv[1:4]
    dataset = load_dataset("json", data_files=data_file, split="train")

    # Reward functions with TRL's contract: keyword arguments, extra columns, a list of floats (or None).
    def format_reward(completions, **kwargs):
        return [1.0 if c[0]["content"].strip().isdigit() else 0.0 for c in completions]

    def answer_reward(completions, answer, **kwargs):
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

    training_args = GRPOConfig(
        output_dir=out_dir,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        beta=0.04,
        loss_type="dapo",
        scale_rewards="group",
        reward_weights=[0.5, 1.0],
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[format_reward, answer_reward],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()
    keys = sorted(trainer.state.log_history[0])
    print("RESULT " + json.dumps({{"steps": trainer.state.global_step, "keys": keys}}))
''')


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("compat")
    model = make_tiny_model(tokenizer)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    copy_digits_dataset(16, conversational=True).to_json(str(root / "data.jsonl"))
    return root


def run_script(root, import_line, name):
    script = root / f"script_{name}.py"
    script.write_text(SCRIPT.format(import_line=import_line))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(root / "model"), str(root / "data.jsonl"),
                           str(root / f"out-{name}")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_trl_script_runs_after_swapping_the_import(assets):
    ours = run_script(assets, "from grpo_trainer import GRPOConfig, GRPOTrainer", "ours")
    trl = run_script(assets, "from trl import GRPOConfig, GRPOTrainer", "trl")
    assert ours["steps"] == trl["steps"] == 2
    shared = {"reward", "reward_std", "kl", "entropy", "frac_reward_zero_std", "num_tokens",
              "rewards/format_reward/mean", "rewards/answer_reward/mean", "completions/mean_length",
              "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "loss", "grad_norm",
              "learning_rate"}
    assert shared <= set(ours["keys"]) and shared <= set(trl["keys"])


# TRL's own training script (`trl grpo` runs trl/scripts/grpo.py from the installed package), with TRL's classes
# replaced by ours in the `trl` namespace the script imports them from; nothing else of the script changes.
TRL_SCRIPT_DRIVER = textwrap.dedent('''
    import trl
    import grpo_trainer

    trl.GRPOConfig, trl.GRPOTrainer = grpo_trainer.GRPOConfig, grpo_trainer.GRPOTrainer
    from trl.scripts import grpo

    script_args, training_args, model_args, dataset_args = grpo.make_parser().parse_args_and_config(
        fail_with_unknown_args=False)
    assert type(training_args) is grpo_trainer.GRPOConfig, type(training_args)
    grpo.main(script_args, training_args, model_args, dataset_args)
''')


def test_trls_own_grpo_script_trains_with_our_classes(tmp_path, tokenizer):
    from safetensors.torch import load_file

    model = make_tiny_model(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    # a local dataset folder (split "train"), conversational: TRL's think_format_reward reads chat completions
    copy_digits_dataset(8, conversational=True).to_json(str(tmp_path / "data" / "train.jsonl"))
    (tmp_path / "my_rewards.py").write_text(  # the script imports dotted reward paths from the working directory
        "def varied(completions, **kwargs):\n"
        "    return [len(c[0]['content']) + 0.1 * i for i, c in enumerate(completions)]\n")
    (tmp_path / "driver.py").write_text(TRL_SCRIPT_DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    argv = ["--model_name_or_path", "model", "--dataset_name", "data", "--reward_funcs", "my_rewards.varied",
            "think_format_reward", "--output_dir", "out", "--per_device_train_batch_size", "4", "--num_generations",
            "2", "--max_completion_length", "8", "--max_steps", "2", "--learning_rate", "0.1", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--dtype", "float32"]
    proc = subprocess.run([sys.executable, "driver.py", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Training completed" in proc.stdout and "Model saved to out" in proc.stdout
    with open(tmp_path / "out" / "checkpoint-2" / "trainer_state.json") as f:
        state = json.load(f)
    assert state["global_step"] == 2
    assert {"rewards/varied/mean", "rewards/think_format_reward/mean"} <= set(state["log_history"][0])
    trained = load_file(str(tmp_path / "out" / "model.safetensors"))
    initial = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert all(not torch.equal(trained[name], initial[name]) for name in initial)
