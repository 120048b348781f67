"""The vLLM backend's up-front refusals that need no vLLM: the package missing, an unverified version, a head size
vLLM's CPU attention cannot run. (With vLLM installed, tests/vllm_integration/ checks the rest against the real
package.)"""

import pytest

from grpo_trainer.config import GRPOConfig
from grpo_trainer.rollout.vllm import checks

needs_no_vllm = pytest.mark.skipif(checks.installed_version() is not None, reason="vLLM is installed here")


@needs_no_vllm
def test_a_missing_vllm_is_refused_before_any_model_loads_naming_what_to_install(tokenizer, toy_dataset):
    from grpo_trainer import GRPOTrainer
    from grpo_trainer.rewards.library import copy_digits_reward

    args = GRPOConfig(output_dir="unused", report_to="none", use_vllm=True, per_device_train_batch_size=8,
                      num_generations=4)
    # a model id that does not exist: nothing may try to load it before the error
    with pytest.raises(ImportError, match=r"needs vLLM, which is not installed: install it with `pip install "
                                          r"'grpo_trainer\[vllm\]'`.*scripts/vllm_cpu_env.sh"):
        GRPOTrainer("no/such-model", copy_digits_reward, args=args, train_dataset=toy_dataset,
                    processing_class=tokenizer)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.32.0+cpu", "0.32.1rc1.dev3"])
def test_supported_versions(version):
    checks.check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.9.2"])
def test_unverified_versions_are_refused_with_the_range(version, monkeypatch):
    monkeypatch.delenv(checks.UNTESTED_OPT_IN, raising=False)
    with pytest.raises(ImportError, match=rf"needs vLLM >= 0.32.0 and < 0.33.0, the versions this package was tested "
                                          rf"with; vLLM {version} is installed.*set GRPO_TRAINER_UNTESTED_VLLM=1"):
        checks.check_version(version)


def test_an_unverified_version_is_a_warning_when_opted_in(monkeypatch):
    monkeypatch.setenv(checks.UNTESTED_OPT_IN, "1")
    with pytest.warns(UserWarning, match="needs vLLM >= 0.32.0 and < 0.33.0.*Going on because "
                                         "GRPO_TRAINER_UNTESTED_VLLM=1"):
        checks.check_version("0.33.1")


def test_setup_cfg_states_the_supported_range():
    """The `vllm` extra admits exactly the versions the code accepts: >= low, < high."""
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[3] / "setup.cfg").read_text()
    extra = setup.split("\nvllm =", 1)[1].split("\n")[1].strip()
    low, high = checks.SUPPORTED_VERSIONS
    assert extra == f"vllm>={low},<{high}"


def test_head_dim_from_the_config(tiny_model):
    assert checks.head_dim(tiny_model.config) == 64 // 4  # hidden_size / num_attention_heads
    tiny_model.config.head_dim = 32
    assert checks.head_dim(tiny_model.config) == 32  # an explicit head_dim wins


def test_a_head_size_the_cpu_kernels_lack_is_refused_on_cpu_only(tiny_model):
    with pytest.raises(ValueError, match=r"head size is 16 .* support only \[32, 64, 80"):
        checks.check_head_dim(tiny_model.config, cpu=True)
    checks.check_head_dim(tiny_model.config, cpu=False)  # GPU kernels take it
    tiny_model.config.head_dim = 64
    checks.check_head_dim(tiny_model.config, cpu=True)
