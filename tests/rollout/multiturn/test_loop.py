"""The tool loop over a scripted backend: what each turn is given, where tool tokens land (env_mask), the
completion budget, the iteration limit, and the rollout it all becomes."""

import pytest
import torch

from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.rollout.multiturn.chat import ToolSuffix
from grpo_trainer.rollout.multiturn.loop import Trajectory, left_padded, run_tool_loop, to_rollout
from grpo_trainer.rollout.multiturn.tool_calls import select_parser
from grpo_trainer.rollout.multiturn.tools import toolbox
from grpo_trainer.rollout.types import Rollout, completion_mask
from tests.tool_helpers import get, multiply

TOKENIZER = make_tokenizer(tool_calling=True)
END = TOKENIZER.convert_tokens_to_ids("<|end|>")
CALL, ANSWER, SUFFIX = "<call>get</call><|end|>", "42<|end|>", "<|tool|>42<|end|><|assistant|>"


def ids(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Script:
    """A stand-in rollout backend: each turn, every row gets the next scripted text (cut at `max_new_tokens`)."""

    def __init__(self, *turns):
        self.turns, self.seen = list(turns), []

    def __call__(self, prompts, max_new_tokens, continuation):
        self.seen.append((prompts, max_new_tokens, continuation))
        rows = [ids(text)[:max_new_tokens] for text in self.turns.pop(0)]
        width = max(map(len, rows))
        completion = torch.tensor([row + [TOKENIZER.pad_token_id] * (width - len(row)) for row in rows])
        mask, truncated = completion_mask(completion, [END])
        return Rollout(prompts.ids, prompts.mask, completion, mask, truncated)


def start(texts, prompt="<|user|>hi<|end|><|assistant|>"):
    parser = select_parser(TOKENIZER)
    trajectories = []
    for text in texts:
        trajectory = Trajectory(ids(prompt))
        turn = ids(text)
        trajectory.add_turn(turn, turn[-1] == END, parser, [get])
        trajectories.append(trajectory)
    return trajectories, parser


def loop(trajectories, parser, script, max_iterations=None, max_completion_length=64, max_context=None):
    suffix = ToolSuffix(TOKENIZER, [END])
    return run_tool_loop(trajectories, script, parser, [toolbox([get, multiply])] * len(trajectories),
                         [[get, multiply]] * len(trajectories), suffix, TOKENIZER.pad_token_id,
                         max_iterations=max_iterations, max_completion_length=max_completion_length,
                         max_context=max_context)


def test_a_call_gets_its_result_and_the_next_turn_sees_the_whole_context():
    trajectories, parser = start([CALL, "no tool<|end|>"])
    script = Script([ANSWER])
    counts = loop(trajectories, parser, script)
    (prompts, max_new, continuation), = script.seen
    called = trajectories[0]
    # Only the row that called continues; its context is prompt + its turn + the tool's result.
    assert prompts.ids.shape[0] == 1 and continuation
    assert prompts.ids[0][prompts.mask[0].bool()].tolist() == ids("<|user|>hi<|end|><|assistant|>" + CALL + SUFFIX)
    assert max_new == 64 - len(ids(CALL + SUFFIX))
    assert called.completion_ids == ids(CALL + SUFFIX + ANSWER)
    # env_mask: 1 over the sampled turns, 0 over exactly the tool's tokens.
    assert called.env_mask == [1] * len(ids(CALL)) + [0] * len(ids(SUFFIX)) + [1] * len(ids(ANSWER))
    assert called.messages[1] == {"role": "tool", "name": "get", "content": "42"}
    assert called.messages[2] == {"role": "assistant", "content": "42"} and called.ended
    assert trajectories[1].completion_ids == ids("no tool<|end|>") and len(trajectories[1].messages) == 1
    assert (counts.calls, counts.failures, counts.results_kept) == (1, 0, 1)


def test_failed_calls_are_counted_and_answered_with_the_error():
    trajectories, parser = start(["<call>multiply a=3 c=4</call><call>nope</call><|end|>"])
    counts = loop(trajectories, parser, Script([ANSWER]), max_completion_length=400)  # errors are long texts
    assert (counts.calls, counts.failures) == (2, 2)
    assert [m["role"] for m in trajectories[0].messages] == ["assistant", "tool", "tool", "assistant"]
    assert "TypeError" in trajectories[0].messages[1]["content"]


@pytest.mark.parametrize(("limit", "turns"), [(0, 1), (1, 2), (2, 3), (None, 4)])
def test_max_tool_calling_iterations_bounds_the_rounds_of_calls(limit, turns):
    # The scripted model calls again every turn; the fourth turn answers.
    trajectories, parser = start([CALL])
    script = Script([CALL], [CALL], [ANSWER])
    counts = loop(trajectories, parser, script, max_iterations=limit)
    assert counts.calls == turns - 1 and len(script.seen) == turns - 1
    assert sum(m["role"] == "assistant" for m in trajectories[0].messages) == turns


def test_results_that_leave_no_room_for_a_sampled_token_are_dropped_and_turns_are_cut_to_the_budget():
    budget = len(ids(CALL + SUFFIX)) + 1  # room for one sampled token after the result
    trajectories, parser = start([CALL, CALL])
    trajectories[1].completion_ids += ids("xx")  # this row has used two more tokens: no room after its result
    trajectories[1].env_mask += [1, 1]
    script = Script([ANSWER])
    loop(trajectories, parser, script, max_completion_length=budget)
    assert script.seen[0][1] == 1 and script.seen[0][0].ids.shape[0] == 1
    assert len(trajectories[0].completion_ids) == budget and not trajectories[0].ended  # "4" only: out of budget
    assert trajectories[1].completion_ids == ids(CALL + "xx") and trajectories[1].ended  # ends with its call
    assert [m["role"] for m in trajectories[1].messages] == ["assistant"]


def test_the_models_context_length_also_bounds_a_turn():
    trajectories, parser = start([CALL])
    context = len(trajectories[0].context) + len(ids(SUFFIX))  # the result fits, nothing after it would
    script = Script([ANSWER])
    loop(trajectories, parser, script, max_context=context)
    assert script.seen == [] and [m["role"] for m in trajectories[0].messages] == ["assistant"]


def test_a_turn_cut_by_its_budget_calls_nothing_more():
    trajectories, parser = start(["<call>get</call>"])  # no EOS: the backend ran out of tokens
    assert not trajectories[0].ended
    script = Script()
    assert loop(trajectories, parser, script).calls == 0 and script.seen == []


def test_trajectories_become_one_rollout_with_its_env_mask():
    trajectories, parser = start([CALL, "no<|end|>"])
    loop(trajectories, parser, Script(["4"]))  # the answer never ends: truncated
    prompts = left_padded([t.prompt_ids for t in trajectories], TOKENIZER.pad_token_id)
    out = to_rollout(prompts, trajectories, TOKENIZER.pad_token_id)
    width = len(ids(CALL + SUFFIX + "4"))
    assert out.completion_ids.shape == (2, width) and out.env_mask.shape == (2, width)
    assert out.completion_mask.tolist() == [[1] * width, [1] * 3 + [0] * (width - 3)]
    assert out.env_mask[0].tolist() == trajectories[0].env_mask and out.env_mask[1, :3].tolist() == [1, 1, 1]
    assert out.is_truncated.tolist() == [True, False]
    assert out.sampled_mask.sum(1).tolist() == [len(ids(CALL)) + 1, 3]  # tool tokens are not the model's
    assert out.sampler.logps is None and out.sampler.replay.layer_outputs is None
