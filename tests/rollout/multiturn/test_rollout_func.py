"""The rollout_func contract: required keys named when missing, lengths checked, extra fields for the rewards."""

import pytest

from grpo_trainer.rollout.multiturn.rollout_func import call_rollout_func


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\] in its output dict"):
        call_rollout_func(lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}, ["p"], None)


def test_one_entry_per_prompt_and_one_value_per_completion_token():
    def short(prompts, trainer):
        return {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]}

    with pytest.raises(ValueError, match="1 entries for 'prompt_ids'.*one entry per prompt \\(2\\)"):
        call_rollout_func(short, ["p", "q"], None)

    def ragged(prompts, trainer):
        return {"prompt_ids": [[1]], "completion_ids": [[2, 3]], "logprobs": [[0.0, 0.0]], "env_mask": [[1]]}

    with pytest.raises(ValueError, match="for prompt 0, 2 completion_ids but 2 logprobs and 1 env_mask values"):
        call_rollout_func(ragged, ["p"], None)


def test_the_output_is_typed_and_extra_fields_go_to_the_rewards():
    seen = {}

    def rollout(prompts, trainer):
        seen["args"] = (prompts, trainer)
        prompts[0].append("edited")  # a copy: the trainer's prompts stay as they were
        return {"prompt_ids": [[1], [1]], "completion_ids": [[2, 3], [4]], "logprobs": [[-0.1, -0.2], [-0.3]],
                "env_mask": [[1, 0], [1]], "judge": ["a", "b"], "run_id": 7}

    prompts = [["m"], ["n"]]
    out = call_rollout_func(rollout, prompts, "trainer")
    assert seen["args"][1] == "trainer" and prompts == [["m"], ["n"]]
    assert out.prompt_ids == [[1], [1]] and out.completion_ids == [[2, 3], [4]] and out.env_mask == [[1, 0], [1]]
    assert out[0] == out.prompt_ids and out[2] == out.env_mask  # TRL's `_generate` order
    assert out.extra == {"judge": ["a", "b"], "run_id": [7, 7]}
