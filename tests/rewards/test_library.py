"""Built-in rewards by name: values on hand-made completions, `module:function` loading, required columns."""

import pytest

from grpo_trainer.cli.toy import copy_digits_reward
from grpo_trainer.rewards import library as reward_library

LENGTH = 8  # max_completion_length


def test_accuracy_verifies_math_in_text_and_chat_completions():
    accuracy = reward_library.get_reward_func("accuracy", LENGTH)
    completions = ["so \\boxed{\\frac{1}{2}}", [{"role": "assistant", "content": "The answer is $0.5$."}], "\\boxed{3}"]
    assert accuracy(completions=completions, solution=["1/2", "0.5", "4"]) == [1.0, 1.0, 0.0]
    assert accuracy(completions=["\\boxed{1}"], solution=["no number"]) == [None]  # unparseable gold: skipped


def test_open_r1_reward_names():
    """open-r1's recipes name `format`, `tag_count`, `reasoning_steps` and `soft_overlong_punishment`."""
    strict = reward_library.get_reward_func("format", LENGTH)
    tag_count = reward_library.get_reward_func("tag_count", LENGTH)
    steps = reward_library.get_reward_func("reasoning_steps", LENGTH)
    full = "<think>\nadd\n</think>\n<answer>\n4\n</answer>"
    same_line = "<think>add</think>\n<answer>\n4\n</answer>"  # <think> without its newlines
    chat = [{"role": "assistant", "content": full}]
    assert strict(completions=[full, same_line, chat, full + "\nmore"]) == [1.0, 0.0, 1.0, 1.0]  # `$` ends a line
    # tags present exactly once: all 4 -> 1.0; same_line lacks "<think>\n" and "\n</think>\n" -> 0.5;
    # "<answer>\n" alone lacks the leading newline of "\n<answer>\n" -> 0.0; a doubled "\n</answer>" -> 0.75
    assert tag_count(completions=[full, same_line, "<answer>\n", full + "\n</answer>"]) == [1.0, 0.5, 0.0, 0.75]
    # markers: "Step 1:" "Step 2:" -> 2/3; "First," "Next," "Finally," + "\n-" -> 4, capped at 1; none -> 0
    assert steps(completions=["Step 1: a Step 2: b", "First, a. Next, b. Finally,\n- c", "4"]) == [
        pytest.approx(2 / 3), 1.0, 0.0]
    assert reward_library.REWARD_FUNCS["soft_overlong_punishment"] is reward_library.REWARD_FUNCS["soft_overlong"]


def test_format_rewards():
    think = reward_library.get_reward_func("think_format", LENGTH)
    think_answer = reward_library.get_reward_func("think_answer_format", LENGTH)
    completions = ["<think>add</think> <answer>4</answer>", "<think>add</think>4", "4"]
    assert think(completions=completions) == [1.0, 1.0, 0.0]
    assert think_answer(completions=completions) == [1.0, 0.0, 0.0]


def test_length_rewards_follow_max_completion_length():
    ids = [[7] * 2, [7] * 6, [7] * 7, [7] * 8]
    # length_penalty: -len / 8
    assert reward_library.get_reward_func("length_penalty", LENGTH)(completion_ids=ids) == [-0.25, -0.75, -0.875, -1.0]
    # DAPO soft overlong, L_max = 8, L_cache = 8 // 4 = 2: 0 up to 6 tokens, (6 - len) / 2 above
    assert reward_library.get_reward_func("soft_overlong", LENGTH)(completion_ids=ids) == [0.0, 0.0, -0.5, -1.0]


def test_copy_digits_is_the_tiny_task_reward():
    assert reward_library.get_reward_func("copy_digits", LENGTH) is copy_digits_reward


def test_user_function_from_a_file_and_a_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text("def short(completions, target, **kwargs):\n"
                                             "    return [-len(c) for c in completions]\n")
    from_file = reward_library.get_reward_func(f"{tmp_path}/user_rewards.py:short", LENGTH)
    assert from_file(completions=["ab", "a"], target=[0, 0]) == [-2, -1]
    monkeypatch.chdir(tmp_path)  # a module name resolves from the working directory, as for a console script
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_library.get_reward_func("user_rewards:short", LENGTH).__name__ == "short"


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match=r"unknown reward function 'acc'.*'accuracy'.*'think_format'"):
        reward_library.get_reward_func("acc", LENGTH)
    with pytest.raises(ValueError, match="reward file 'missing.py' does not exist"):
        reward_library.get_reward_func("missing.py:f", LENGTH)


def test_required_columns_come_from_the_signature():
    def custom(prompts, completions, completion_ids, target, trainer_state=None, weight=1.0, **kwargs):
        return []

    assert reward_library.required_columns(custom) == {"target"}
    assert reward_library.required_columns(reward_library.get_reward_func("accuracy", LENGTH)) == {"solution"}
    assert reward_library.required_columns(copy_digits_reward) == {"answer"}
    assert reward_library.required_columns(reward_library.get_reward_func("soft_overlong", LENGTH)) == set()
