"""`grpo-train --config` takes an open-r1 / `trl grpo` YAML recipe unchanged: every key of open-r1's GRPO recipes is
mapped, exported, warned about or refused by name, and a recipe with those keys (model and data pointed at local
files, GPU-only and network values swapped for CPU-offline ones) trains."""

import json
import os
import warnings

import pytest

from grpo_trainer.cli import command as cli
from grpo_trainer.cli import recipe
from grpo_trainer.cli.toy import make_tiny_model

# The keys (in their order) of open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml plus the ones its
# DeepSeek-R1-Distill and Qwen2.5-Coder codeforces recipes add. Values differ only where the real ones need a GPU
# (flash_attention_2, vLLM, Liger), the network (push_to_hub, wandb), or hours (sizes, steps).
RECIPE = """\
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: float32
attn_implementation: sdpa

# Data training arguments
chat_template: "{{% for m in messages %}}<|{{{{ m['role'] }}}}|>{{{{ m['content'] }}}}<|end|>{{% endfor %}}\
{{% if add_generation_prompt %}}<|assistant|>{{% endif %}}"
dataset_name: {data}
dataset_prompt_column: problem
dataset_train_split: train
system_prompt: "Think, then answer: <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>"

# GRPO trainer config
callbacks:
- push_to_hub_revision
benchmarks:
- lcb_v4
beta: 0.0
loss_type: dr_grpo
scale_rewards: false
bf16: false
use_vllm: false
vllm_device: auto
vllm_gpu_memory_utilization: 0.7
do_eval: false
eval_strategy: "no"
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_model_revision: v01.00
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
mask_truncated_completions: true
max_grad_norm: 0.2
max_prompt_length: 512
max_completion_length: 8
max_steps: 2
num_generations: 4
num_train_epochs: 1
output_dir: {output}
overwrite_output_dir: true
per_device_eval_batch_size: 4
per_device_train_batch_size: 4
push_to_hub: false
report_to:
- none
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
temperature: 0.7
use_liger_kernel: false
warmup_ratio: 0.1
wandb_entity: huggingface
wandb_project: open-r1
code_eval_test_batch_size: -1
code_eval_scoring_mode: weighted_sum
"""


@pytest.fixture
def recipe_file(tmp_path, tokenizer):
    model_dir = tmp_path / "model"
    make_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "math.jsonl"
    rows = [{"problem": f"What is {a} + {a}?", "solution": f"${2 * a}$"} for a in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = tmp_path / "config_demo.yaml"
    path.write_text(RECIPE.format(model=model_dir, data=data, output=tmp_path / "out"))
    return str(path)


@pytest.fixture
def clean_wandb_env(monkeypatch):
    for name in recipe.ENVIRONMENT.values():
        monkeypatch.delenv(name, raising=False)
    yield
    for name in recipe.ENVIRONMENT.values():
        os.environ.pop(name, None)


def test_an_open_r1_recipe_parses_with_every_key_accounted_for(recipe_file, clean_wandb_env):
    with pytest.warns(UserWarning) as caught:
        script_args, config, _, dataset, eval_dataset = cli.prepare(["--config", recipe_file])
    messages = "\n".join(str(w.message) for w in caught)
    for key in ("callbacks", "benchmarks", "code_eval_test_batch_size", "code_eval_scoring_mode"):
        assert f"{key!r} in {recipe_file} has no effect with grpo-train" in messages
    assert "overwrite_output_dir is a legacy option" in messages and "vllm_device is a legacy option" in messages
    assert script_args.prompt_column == "problem" and script_args.dtype == "float32"
    assert config.model_init_kwargs == {"revision": "main", "dtype": "float32", "attn_implementation": "sdpa"}
    assert config.hub_revision == "v01.00" and config.scale_rewards == "none" and config.loss_type == "dr_grpo"
    assert os.environ["WANDB_ENTITY"] == "huggingface" and os.environ["WANDB_PROJECT"] == "open-r1"
    assert dataset[0]["prompt"][0]["role"] == "system" and dataset[0]["prompt"][1]["content"] == "What is 0 + 0?"
    assert eval_dataset is None  # eval_strategy: "no"


def test_an_open_r1_recipe_trains(recipe_file, clean_wandb_env, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli.main(["--config", recipe_file])
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "reward" in row]
    assert [row["step"] for row in train_rows] == [1, 2]
    assert {"rewards/accuracy_reward/mean", "rewards/strict_format_reward/mean", "rewards/tag_count_reward/mean"} \
        <= set(train_rows[0])
    assert (tmp_path / "out" / "model.safetensors").exists()
    with open(tmp_path / "out" / "tokenizer_config.json") as f:  # the recipe's chat template went with the model
        assert "<|assistant|>" in f.read()


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_keys_whose_effect_grpo_train_cannot_give_are_refused_by_name(tmp_path, capsys):
    path = tmp_path / "mixture.yaml"
    path.write_text("dataset_mixture:\n  datasets:\n  - id: org/data\n")
    assert "'dataset_mixture' in" in _error(capsys, ["--demo", "--config", str(path)])
    path.write_text("reward_funcs: [cf_code]\n")  # open-r1's code-execution reward: not built in
    assert "unknown reward function 'cf_code'" in _error(capsys, ["--demo", "--config", str(path)])
    path.write_text("dataset_prompt_column: question\nprompt_column: problem\n")
    assert "two names of one setting" in _error(capsys, ["--demo", "--config", str(path)])
    path.write_text("learning_rat: 0.1\n")  # a typo is still an error, not a warning
    assert "unknown field 'learning_rat'" in _error(capsys, ["--demo", "--config", str(path)])


def test_trls_env_mapping_and_model_keys_as_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_RECIPE_TEST", raising=False)
    path = tmp_path / "env.yaml"
    path.write_text("env:\n  GRPO_RECIPE_TEST: '1'\nmodel_init_kwargs:\n  dtype: bfloat16\n")
    script_args, config, *_ = cli.prepare(["--demo", "--config", str(path), "--dtype", "float16",
                                           "--model_revision", "v2"])
    assert os.environ.pop("GRPO_RECIPE_TEST") == "1"
    # TRL's script: model_init_kwargs from the recipe win over the model keys
    assert config.model_init_kwargs == {"revision": "v2", "dtype": "bfloat16"}


def test_an_eval_split_is_loaded_only_when_the_run_evaluates(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "copy 1:", "answer": "1"}) + "\n")
    message = _error(capsys, ["--demo", "--dataset_name", str(data), "--eval_strategy", "steps",
                              "--per_device_eval_batch_size", "16"])
    assert "needs a test split" in message and "single split" in message
