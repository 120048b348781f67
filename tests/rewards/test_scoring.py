"""The reward-function contract: keyword arguments, missing values, async functions, errors, reward models."""

import asyncio
import math
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config

from grpo_trainer.rewards.scoring import RewardError, RewardModel, reward_name, score_completions
from tests.helpers import make_trainer

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]
COMPLETION_IDS = [[1], [2, 2], [3, 3, 3]]


def score(funcs, policy="raise", columns=None, timeout=None, **extra):
    return score_completions(funcs, [reward_name(f) for f in funcs], PROMPTS, COMPLETIONS, COMPLETION_IDS,
                             columns or {}, policy, timeout, **extra)


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_every_argument_arrives_by_keyword():
    seen = {}

    def spy(*args, prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        assert args == ()  # keyword-only contract, as TRL
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer,
                    trainer_state=trainer_state, rest=kwargs)
        return [1.0, 2.0, 3.0]

    out = score([spy], columns={"answer": ["x", "y", "z"], "level": [1, 2, 3]}, trainer_state="STATE")
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "completion_ids": COMPLETION_IDS,
                    "answer": ["x", "y", "z"], "trainer_state": "STATE", "rest": {"level": [1, 2, 3]}}
    assert out.tolist() == [[1.0], [2.0], [3.0]]


def test_columns_of_several_functions_and_none_becomes_nan():
    def only_first(completions, **kwargs):
        return [0.5, None, None]

    out = score([length, only_first])
    assert out.shape == (3, 2) and out.dtype == torch.float32
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert out[0, 1].item() == 0.5 and torch.isnan(out[1:, 1]).all()


def test_tensor_return_value_is_accepted():
    out = score([lambda completions, **kwargs: torch.tensor([0.0, 1.0, 0.0])])
    assert out[:, 0].tolist() == [0.0, 1.0, 0.0]


def test_async_functions_run_concurrently():
    # `waiter` is first in the list and can only finish once `setter` has run: sequential execution would time out.
    state = {}

    async def waiter(completions, **kwargs):
        state["event"] = state.get("event") or asyncio.Event()
        await asyncio.wait_for(state["event"].wait(), timeout=5)
        return [1.0] * len(completions)

    async def setter(completions, **kwargs):
        state["event"] = state.get("event") or asyncio.Event()
        await asyncio.sleep(0)
        state["event"].set()
        return [2.0] * len(completions)

    out = score([waiter, length, setter])
    assert out.tolist() == [[1.0, 1.0, 2.0], [1.0, 2.0, 2.0], [1.0, 3.0, 2.0]]


def test_async_function_inside_a_running_loop():
    async def half(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    async def caller():  # e.g. a notebook: score_completions is called while an event loop runs
        return score([half])

    assert asyncio.run(caller())[:, 0].tolist() == [0.5, 0.5, 0.5]


def test_wrong_length_names_the_function():
    def two_values(completions, **kwargs):
        return [1.0, 2.0]

    with pytest.raises((ValueError, RewardError), match="reward function 'two_values' returned 2 values"):
        score([two_values])


def test_raising_function_names_function_sample_and_prompt():
    def fragile(prompts, completions, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]  # "bb" (sample 1) divides by zero

    with pytest.raises(RewardError) as info:
        score([fragile])
    message = str(info.value)
    assert "'fragile'" in message and "sample 1" in message and "'p1'" in message
    assert "ZeroDivisionError" in message and "reward_error_policy='none'" in message


def test_async_raising_function_is_located_too():
    async def fragile(completions, **kwargs):
        if "bb" in completions:
            raise KeyError("no answer")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'fragile' failed on sample 1 \(KeyError"):
        score([fragile])


def test_policy_none_turns_only_the_failing_sample_into_nan():
    def fragile(completions, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]  # 1/(1-2) = -1, fails, 1/(3-2) = 1

    out = score([fragile, length], policy="none")
    assert out[0, 0].item() == -1.0 and math.isnan(out[1, 0].item()) and out[2, 0].item() == 1.0
    assert out[:, 1].tolist() == [1.0, 2.0, 3.0]  # the other function is untouched


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_computed_nan_or_inf_reward_is_an_error(bad):
    calls = []

    def explodes(completions, **kwargs):
        calls.append(len(completions))
        return [0.0, bad, 0.5]  # a batch-level score: it would change if the function were re-called per sample

    with pytest.raises(RewardError, match=r"'explodes' failed on sample 1 \(returned (-?inf|nan)\); prompt: 'p1'"):
        score([explodes])
    out = score([explodes], policy="none")
    assert out[0, 0].item() == 0.0 and math.isnan(out[1, 0].item()) and out[2, 0].item() == 0.5
    assert calls == [3, 3]  # the batch result names the sample: no per-sample re-calls


def test_infinite_reward_found_while_locating_another_failure():
    def fragile(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch failed")
        return [math.inf if completions[0] == "ccc" else 1.0]

    with pytest.raises(RewardError, match=r"'fragile' failed on sample 2 \(ValueError: returned inf\)"):
        score([fragile])
    out = score([fragile], policy="none")
    assert out[:2, 0].tolist() == [1.0, 1.0] and math.isnan(out[2, 0].item())


def test_logging_callables_reach_the_function_and_one_sample_reruns_log_nothing():
    logged = []

    def fragile(completions, log_extra, log_metric, **kwargs):
        log_extra("seen", list(completions))
        log_metric("batch", float(len(completions)))
        if len(completions) > 1:
            raise RuntimeError("batch failed")  # the per-sample re-run scores it
        return [1.0]

    out = score([fragile], policy="none", log_extra=lambda c, v: logged.append((c, v)),
                log_metric=lambda n, v: logged.append((n, v)))
    assert out[:, 0].tolist() == [1.0, 1.0, 1.0]
    # only the batch call logged: a one-sample call's column would be a fragment of the round's
    assert logged == [("seen", COMPLETIONS), ("batch", 3.0)]


def test_reward_name():
    assert reward_name(length) == "length"
    assert reward_name("org/some-reward-model/") == "some-reward-model"


# ---------------------------------------------------------------------------------------------------------------
# Reward models
# ---------------------------------------------------------------------------------------------------------------


def test_reward_model_scores_in_micro_batches(tokenizer):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    prompts, completions = ["copy 12:", "copy 3:", "x"], ["12", "3<eos>", "a long completion"]
    reward = RewardModel(model, tokenizer, batch_size=1)
    assert reward.__name__ == "Qwen2ForSequenceClassification"
    assert model.config.pad_token_id == tokenizer.pad_token_id  # set so the model finds each row's last token
    one_by_one = reward(prompts=prompts, completions=completions)
    reward.batch_size = 3
    together = reward(prompts=prompts, completions=completions)
    assert len(one_by_one) == 3 and len(set(one_by_one)) == 3  # distinct texts, distinct scores
    assert together == pytest.approx(one_by_one, abs=1e-5)
    # the score is logits[:, 0] of prompt + completion
    with torch.no_grad():
        single = model(**tokenizer(["x" + "a long completion"], return_tensors="pt")).logits[0, 0].item()
    assert one_by_one[2] == pytest.approx(single, abs=1e-5)
    # through score_completions like any reward function
    out = score_completions([reward], ["rm"], prompts, completions, [[0]] * 3, {})
    assert out[:, 0].tolist() == pytest.approx(one_by_one, abs=1e-5)


# --------------------------------------------------------------------------------- value types, timeouts


@pytest.mark.parametrize("values, expected", [
    (np.array([0.5, 1.0, 2.0], dtype=np.float32), [0.5, 1.0, 2.0]),
    ([np.float32(0.5), np.float64(1.0), np.int64(2)], [0.5, 1.0, 2.0]),
    (np.array([0.5, None, 2.0], dtype=object), [0.5, None, 2.0]),
    ([torch.tensor(0.5), torch.tensor([1.0]), np.array(2.0)], [0.5, 1.0, 2.0]),  # 0-d and one-element
    (torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64), [0.5, 1.0, 2.0]),
    ((0.5, True, 2), [0.5, 1.0, 2.0]),
    ([np.float16(0.5), np.bool_(True), None], [0.5, 1.0, None]),
    (np.array([True, False, True]), [1.0, 0.0, 1.0]),
    (torch.tensor([False, True, True]), [0.0, 1.0, 1.0]),
], ids=["ndarray", "numpy scalars", "object array with None", "0-d tensors", "float64 tensor", "tuple with bool",
        "float16, bool_ and None", "bool array", "bool tensor"])
def test_every_numeric_type_a_function_may_return_is_accepted(values, expected):
    out = score([lambda completions, **kwargs: values])
    assert [None if math.isnan(v) else v for v in out[:, 0].tolist()] == expected


@pytest.mark.parametrize("result, described", [
    (np.float64(1.0), "returned a float64; it must return one number"),
    (1.0, "returned a float; it must return one number"),
    ({"a": 1.0}, "returned a dict; it must return one number"),
    (np.ones((3, 1)), "returned a ndarray of shape (3, 1) for 3 completions"),
    (torch.ones(1, 3), "returned a Tensor of shape (1, 3) for 3 completions"),
])
def test_a_result_of_the_wrong_type_names_the_function_and_the_type_not_a_sample(result, described):
    calls = []

    def scalar(completions, **kwargs):
        calls.append(len(completions))
        return result

    with pytest.raises(RewardError) as error:
        score([scalar])
    assert str(error.value).startswith(f"reward function 'scalar' {described}")
    assert "sample" not in str(error.value) and calls == [3]  # not re-run per sample
    with pytest.warns(UserWarning, match="Its rewards for these 3 completions are missing"):
        assert torch.isnan(score([scalar], policy="none")).all()


def test_a_value_that_is_not_a_number_names_the_sample_and_its_type():
    def stringly(completions, **kwargs):
        return [1.0, "0.5", 2.0]

    with pytest.raises(RewardError, match=r"'stringly' failed on sample 1 \(returned a str, not a number: '0.5'\)"):
        score([stringly])
    out = score([stringly], policy="none")
    assert out[0, 0].item() == 1.0 and math.isnan(out[1, 0].item()) and out[2, 0].item() == 2.0


@pytest.fixture
def release():
    """An event that stuck reward functions wait on; set at the end so their abandoned threads finish."""
    event = threading.Event()
    yield event
    event.set()


def test_a_stuck_function_times_out_by_name_under_either_policy(release):
    def stuck(completions, **kwargs):
        release.wait(60)
        return [1.0] * len(completions)

    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward function 'stuck' did not return within reward_timeout \(0.2 s\) on "
                                          r"3 completions\. Fix the function, or set reward_error_policy='none'"):
        score([length, stuck], timeout=0.2)
    with pytest.warns(UserWarning, match="'stuck' did not return within reward_timeout"):
        out = score([length, stuck], policy="none", timeout=0.2)
    assert time.monotonic() - start < 10  # twice 0.2 s, and no per-sample re-runs of 0.2 s each
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0] and torch.isnan(out[:, 1]).all()


def test_async_functions_time_out_alone_even_one_that_blocks_its_event_loop(release):
    async def awaits_forever(completions, **kwargs):
        await asyncio.sleep(60)

    async def blocks_the_loop(completions, **kwargs):
        release.wait(60)  # synchronous: no await lets the loop run anything else
        return [0.0] * len(completions)

    async def quick(completions, **kwargs):
        return [0.5] * len(completions)

    with pytest.raises(RewardError, match="'awaits_forever' did not return within reward_timeout"):
        score([quick, awaits_forever], timeout=0.3)
    with pytest.raises(RewardError, match="'blocks_the_loop' did not return within reward_timeout"):
        score([blocks_the_loop], timeout=0.3)
    with pytest.warns(UserWarning):
        out = score([quick, awaits_forever, length], policy="none", timeout=0.3)
    assert out[:, 0].tolist() == [0.5] * 3 and torch.isnan(out[:, 1]).all() and out[:, 2].tolist() == [1.0, 2.0, 3.0]


def test_a_timeout_leaves_functions_that_finish_in_time_alone():
    async def quick(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    assert score([length, quick], timeout=30).tolist() == [[1.0, 0.5], [2.0, 0.5], [3.0, 0.5]]


def test_reward_timeout_in_training(tmp_path, tokenizer, toy_dataset, release):
    def stuck_at_step_1(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            release.wait(60)
        return [float(len(c)) for c in completions]

    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, [stuck_at_step_1], reward_timeout=0.5)
    with pytest.raises(RewardError, match="'stuck_at_step_1' did not return within reward_timeout \\(0.5 s\\)"):
        trainer.train()
    assert trainer.state.global_step == 1
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, [stuck_at_step_1, length], reward_timeout=0.5,
                           reward_error_policy="none", max_steps=3)
    with pytest.warns(UserWarning, match="'stuck_at_step_1' did not return within reward_timeout"):
        trainer.train()
    assert trainer.state.global_step == 3
