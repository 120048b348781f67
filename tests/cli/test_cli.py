"""grpo-train: parsing (demo < YAML < flags), --help, every bad-input error, and a real 2-step demo run."""

import glob
import json
import os
import subprocess
import sys

import pytest

from grpo_trainer.cli import command as cli
from tests.helpers import REPO

FAST = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4", "--logging_steps", "1",
        "--max_completion_length", "4", "--save_steps", "1", "--disable_tqdm", "true"]


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_no_arguments_is_the_demo():
    script_args, config = cli.parse_args([])
    assert script_args.model_name_or_path == "builtin:tiny"
    assert script_args.reward_funcs == ["copy_digits"]
    assert config.learning_rate == cli.DEMO["learning_rate"]
    assert config.output_dir == "outputs/demo"


def test_yaml_then_flags_override(tmp_path):
    path = _yaml(tmp_path, "model_name_or_path: org/model\ndataset_name: data.jsonl\nreward_funcs: [accuracy, "
                           "think_format]\nlearning_rate: 1e-5\nnum_generations: 4\nbeta: 0.04\nuse_peft: true\n"
                           "lora_target_modules: [q_proj, v_proj]\n")
    script_args, config = cli.parse_args(["--config", path, "--learning_rate", "3e-4", "--lora_r", "8",
                                          "--output_dir", str(tmp_path)])
    assert script_args.model_name_or_path == "org/model"
    assert script_args.reward_funcs == ["accuracy", "think_format"]
    assert script_args.use_peft is True and script_args.lora_target_modules == ["q_proj", "v_proj"]
    assert script_args.lora_r == 8  # flag only
    assert config.learning_rate == 3e-4  # flag beats YAML
    assert config.num_generations == 4 and config.beta == 0.04  # YAML beats the defaults ("1e-5" is a str in YAML)


def test_flags_override_the_demo():
    script_args, config = cli.parse_args(["--demo", "--max_steps", "7", "--advantage_estimator", "rloo"])
    assert config.max_steps == 7 and config.advantage_estimator == "rloo"
    assert script_args.dataset_name == "builtin:copy_digits"


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--demo", "--reward_funcs", "--use_peft", "--advantage_estimator", "--beta"):
        assert flag in out


def test_lora_flags_build_a_peft_config():
    script_args, _ = cli.parse_args(["--demo", "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
                                     "--lora_target_modules", "q_proj", "v_proj"])
    lora = cli.peft_config(script_args)
    assert (lora.r, lora.lora_alpha, set(lora.target_modules)) == (4, 8, {"q_proj", "v_proj"})


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("grpo-train: error: ")
    return err[-1]


def test_unknown_reward_names_it_and_the_choices(capsys):
    message = _error(capsys, ["--demo", "--reward_funcs", "acuracy"])
    assert "'acuracy'" in message and "accuracy" in message and "think_format" in message


def test_user_reward_module_function(tmp_path, capsys):
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    funcs = cli.load_rewards(cli.parse_args(["--demo", "--reward_funcs", f"{tmp_path}/my_rewards.py:short"])[0],
                             cli.parse_args(["--demo"])[1])
    assert funcs[0].__name__ == "short"
    assert "has no callable 'nope'" in _error(capsys, ["--demo", "--reward_funcs", f"{tmp_path}/my_rewards.py:nope"])
    assert "cannot import module 'no_such_module'" in _error(capsys, ["--demo", "--reward_funcs", "no_such_module:f"])


def test_missing_prompt_column(capsys):
    message = _error(capsys, ["--demo", "--prompt_column", "question"])
    assert "'question'" in message and "['prompt', 'answer']" in message


def test_reward_needs_a_missing_column(capsys):
    # accuracy reads `solution`; the toy dataset has only prompt and answer
    message = _error(capsys, ["--demo", "--reward_funcs", "copy_digits", "accuracy"])
    assert "'accuracy'" in message and "['solution']" in message


def test_missing_files(tmp_path, capsys):
    assert f"config file '{tmp_path}/none.yaml' does not exist" in _error(
        capsys, ["--config", f"{tmp_path}/none.yaml"])
    assert "dataset './nope.jsonl' does not exist" in _error(capsys, ["--demo", "--dataset_name", "./nope.jsonl"])
    assert "model './no_model' does not exist" in _error(capsys, ["--demo", "--model_name_or_path", "./no_model"])


def test_unreadable_config_and_unknown_fields(tmp_path, capsys):
    assert "cannot read config file" in _error(capsys, ["--config", _yaml(tmp_path, "a: [1, 2\n")])
    message = _error(capsys, ["--config", _yaml(tmp_path, "learning_rat: 0.1\n")])
    assert "unknown field 'learning_rat'" in message and "learning_rate" in message
    message = _error(capsys, ["--demo", "--num_generation", "4"])
    assert "'--num_generation'" in message and "--num_generations" in message


def test_invalid_values_are_usage_errors(capsys):
    assert "loss_type" in _error(capsys, ["--demo", "--loss_type", "nope"])
    assert "invalid int value" in _error(capsys, ["--demo", "--max_steps", "many"])
    assert "required" in _error(capsys, ["--learning_rate", "0.1"])


def test_local_jsonl_dataset_with_prompt_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": f"copy {d}:", "answer": d}) + "\n" for d in ("123", "456")))
    script_args, _ = cli.parse_args(["--demo", "--dataset_name", str(path), "--prompt_column", "question",
                                     "--system_prompt", "Copy."])
    dataset = cli.load_train_dataset(script_args)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset[0]["prompt"] == [{"role": "system", "content": "Copy."}, {"role": "user", "content": "copy 123:"}]


def test_demo_two_steps_leaves_everything_to_look_at(tmp_path, capsys):
    out = tmp_path / "demo"
    cli.main(["--demo", "--output_dir", str(out), "--report_to", "tensorboard", *FAST])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert {"reward", "kl", "completions/mean_length", "rewards/copy_digits_reward/mean"} <= set(train_rows[0])
    assert (out / "metrics.png").stat().st_size > 10_000
    completions = sorted(glob.glob(str(out / "completions" / "*.jsonl")))
    assert [os.path.basename(p) for p in completions] == ["completions_00001.jsonl", "completions_00002.jsonl"]
    with open(completions[0]) as f:
        first = json.loads(f.readline())
    assert {"prompt", "completion", "copy_digits_reward", "advantage"} <= set(first)
    assert "Step 2" in capsys.readouterr().out  # the rich table
    assert (out / "checkpoint-2" / "model.safetensors").exists() and (out / "model.safetensors").exists()
    events = glob.glob(str(out / "**" / "events.out.tfevents.*"), recursive=True)
    assert events, "report_to=tensorboard wrote no event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(events[0]).Reload().Tags()["scalars"]
    assert "train/reward" in tags and "train/completions/mean_length" in tags


def test_module_entry_point_reports_bad_input_without_traceback():
    result = subprocess.run([sys.executable, "-m", "grpo_trainer.cli", "--reward_funcs", "nope", "--demo"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("grpo-train: error: unknown reward function 'nope'")


def test_unloadable_hub_dataset_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline, a Hub id cannot be reached: still one line, exit 2
    message = _error(capsys, ["--demo", "--dataset_name", "nobody/no-such-dataset"])
    assert "cannot load dataset 'nobody/no-such-dataset'" in message


def test_yaml_scalar_for_a_list_field(tmp_path):
    script_args, _ = cli.parse_args(["--demo", "--config", _yaml(tmp_path, "reward_funcs: copy_digits\n")])
    assert script_args.reward_funcs == ["copy_digits"]
