"""Every example runs offline (`--smoke`: tiny models, two optimizer steps) and its task-specific rewards are right."""

import ast
import importlib.util
import math
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the module looks it up while it is built
    spec.loader.exec_module(module)
    return module


def _trained_two_steps(trainer) -> list[dict]:
    rows = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 2 and [r["step"] for r in rows] == [1, 2]
    return rows


@pytest.mark.parametrize("name", ["gsm8k_grpo", "reward_model_lora", "rloo", "migrate_from_trainer", "tool_use",
                                  "vlm_colours"])
def test_example_smoke(name, tmp_path):
    trainer = load(name).main(["--smoke", "--output_dir", str(tmp_path)])
    rows = _trained_two_steps(trainer)
    saved = {"model.safetensors", "adapter_model.safetensors"} & set(os.listdir(tmp_path))
    assert saved == ({"adapter_model.safetensors"} if name == "reward_model_lora" else {"model.safetensors"})
    if name != "migrate_from_trainer":  # the migration example stays a plain Trainer script
        assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.png").exists()
        assert sorted(os.listdir(tmp_path / "completions")) == [f"completions_0000{step}.{ext}" for step in (1, 2)
                                                                for ext in ("jsonl", "parquet")]
    if name == "reward_model_lora":
        assert "kl" in rows[0]  # beta=0.04: the adapter-free policy is the reference
    if name == "rloo":
        assert trainer.args.advantage_estimator == "rloo"


def test_reference_grpo_step_smoke():
    history = load("reference_grpo_step").main(["--smoke"])
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert all(h["completion_tokens"] > 0 for h in history)


def test_reference_grpo_step_imports_only_torch_and_transformers():
    """A newcomer reads it first: nothing of grpo_trainer hides behind an import."""
    with open(os.path.join(EXAMPLES, "reference_grpo_step.py")) as f:
        tree = ast.parse(f.read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == {"torch", "transformers"}


def test_gsm8k_rows_carry_the_number_after_the_marks():
    example = load("gsm8k_grpo")
    row = example.to_grpo_rows({"question": "q?", "answer": "12 * 100 = 1,200\n#### 1,200"})
    assert row["solution"] == "1200"
    assert row["prompt"][0]["role"] == "system" and row["prompt"][1] == {"role": "user", "content": "q?"}


def test_rloo_reward_reads_the_last_integer():
    example = load("rloo")
    completions = [[{"content": "12 + 30 = 42"}], [{"content": "41"}], [{"content": "none"}]]
    assert example.exact_sum_reward(completions, target=[42, 42, 42]) == [1.0, 0.0, 0.0]


def test_migration_reward_prefers_the_bare_answer():
    example = load("migrate_from_trainer")
    completions = [[{"content": "Paris."}], [{"content": "It is Paris"}], [{"content": "Lyon"}]]
    assert example.answer_matches(completions, answer=["Paris"] * 3) == [1.0, 0.5, 0.0]


def test_tool_use_reward_reads_each_rollouts_own_vault():
    example = load("tool_use")
    vaults = [example.Vault(), example.Vault()]
    for vault, code in zip(vaults, ["3", "7"]):
        vault.code = code
    completions = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "3"},
                    {"role": "assistant", "content": "3"}],
                   [{"role": "assistant", "content": "3"}]]
    assert example.correct_code(completions, environments=vaults) == [1.0, 0.0]


def test_tool_use_a_tiny_model_learns_to_read_the_vault(tmp_path):
    # After the format warm-up the model reads the vault about half the time; GRPO makes it read every time, and
    # the reward (1 for the right code, 1 in 10 for a guess) rises with it.
    trainer = load("tool_use").main(["--toy", "--max_steps", "30", "--output_dir", str(tmp_path)])
    rows = [h for h in trainer.state.log_history if "reward" in h]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[0]["tools/call_frequency"] < 0.7 and rows[-1]["tools/call_frequency"] > 0.9
    assert (rows[-1]["reward"] + rows[-2]["reward"]) / 2 > rows[0]["reward"] + 0.1


def test_vlm_colour_reward_and_images():
    example = load("vlm_colours")
    completions = [[{"content": "Red."}], [{"content": "reddish"}], [{"content": "blue"}], [{"content": ""}]]
    # "reddish" starts with all 3 letters of "red" but is not the word: 0.5 * 3/3; "blue" vs "red": no letter
    assert example.colour_reward(completions, colour=["red"] * 4) == [1.0, 0.5, 0.0, 0.0]
    dataset = example.colour_dataset(4, size=32)
    row = dataset[0]
    pixels = set(row["image"].getdata())
    assert pixels == {(255, 255, 255), example.COLOURS[row["colour"]]}  # white and the square's colour only
