"""A multi-turn round end to end over a scripted backend: prompts rendered with each rollout's tools, environments
reset and handed to the rewards, a rollout_func's first turn continued by the tool loop, sampler tensors dropped."""


import pytest
import torch

from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.rollout.multiturn import Environments, MultiTurn, TurnSettings, call_rollout_func
from grpo_trainer.rollout.settings import PromptSettings
from grpo_trainer.rollout.types import Rollout, SamplerRecord, completion_mask
from tests.tool_helpers import get, multiply

TOKENIZER = make_tokenizer(tool_calling=True)
END = TOKENIZER.convert_tokens_to_ids("<|end|>")


def ids(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def settings(max_completion_length=64, max_tool_calling_iterations=None, use_vllm=False):
    return TurnSettings(PromptSettings(), max_completion_length, max_tool_calling_iterations,
                        engine_logprobs=use_vllm)


class Script:
    """A stand-in backend answering each turn's rows with scripted texts; the first turn carries sampler values.
    `engine`: every turn also carries engine log-probs, -(turn + 1) at every token of that turn (`engine_lacks`:
    the turns that come back without them)."""

    def __init__(self, *turns, engine=False, engine_lacks=()):
        self.turns, self.prompts = list(turns), []
        self.engine, self.engine_lacks = engine, set(engine_lacks)

    def __call__(self, prompts, max_new_tokens, continuation):
        self.prompts.append(TOKENIZER.batch_decode(prompts.ids, skip_special_tokens=False))
        rows = [ids(text) for text in self.turns.pop(0)]
        width = max(map(len, rows))
        completion = torch.tensor([row + [TOKENIZER.pad_token_id] * (width - len(row)) for row in rows])
        mask, truncated = completion_mask(completion, [END])
        values = None if continuation else torch.zeros(completion.shape)
        turn = len(self.prompts) - 1
        engine = None
        if self.engine and turn not in self.engine_lacks:
            engine = torch.full(completion.shape, -(turn + 1.0)).masked_fill(mask == 0, 0.0)
        record = SamplerRecord("engine", logps=engine) if self.engine else \
            SamplerRecord("decoder", logps=values, entropy=values, exact=values is not None)
        return Rollout(prompts.ids, prompts.mask, completion, mask, truncated, record)


class Door:
    def reset(self, code, **row):
        self.code, self.opened = code, False
        return f" Code {code}."

    def open(self, code: int) -> str:
        """Try a code.

        Args:
            code: The code to try.
        """
        self.opened = code == self.code
        return "open" if self.opened else "locked"

    def get_reward(self) -> float:
        return float(self.opened)


def make(tools=None, environments=None, **overrides):
    multi_turn = MultiTurn(TOKENIZER, settings(**overrides), tools, environments)
    multi_turn.attach_model([TOKENIZER.eos_token_id, END], None)  # the toy model's EOS ids: <eos> and <|end|>
    return multi_turn


def rows(*codes):
    return [{"prompt": [{"role": "user", "content": "Open."}], "code": code} for code in codes]


def test_prompts_describe_the_tools_and_calls_are_counted():
    multi_turn = make([get, multiply], max_completion_length=400)
    script = Script(["no<|end|>", "<call>nope</call><call>get</call><|end|>"], ["42<|end|>"])
    episode = multi_turn.run(rows(1, 2), script, None, "cpu")
    assert script.prompts[0][0].endswith("<|system|>tools: get multiply<|end|><|user|>Open.<|end|><|assistant|>")
    assert (episode.tool_counts.calls, episode.tool_counts.failures) == (2, 1)  # `nope` is no tool
    assert [m["role"] for m in episode.completions[1]] == ["assistant", "tool", "tool", "assistant"]


def test_a_round_whose_calls_got_results_drops_every_sampler_tensor():
    multi_turn = make([get])
    episode = multi_turn.run(rows(1, 2), Script(["no<|end|>", "<call>get</call><|end|>"], ["42<|end|>"]), None,
                             "cpu")
    out = episode.rollout
    assert out.env_mask is not None and out.sampler.logps is None and out.sampler.entropy is None
    assert episode.completions[1] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get", "arguments": {}}}]},
        {"role": "tool", "name": "get", "content": "42"}, {"role": "assistant", "content": "42"}]
    assert episode.completions[0] == [{"role": "assistant", "content": "no"}]


def test_a_round_where_no_tool_answered_is_the_first_turn_as_sampled():
    multi_turn = make([get])
    episode = multi_turn.run(rows(1, 2), Script(["no<|end|>", "nor<|end|>"]), None, "cpu")
    assert episode.rollout.env_mask is None and episode.rollout.sampler.logps is not None
    assert (episode.tool_counts.calls, episode.tool_counts.failures) == (0, 0)


def test_environments_are_reset_with_their_rows_called_and_handed_to_the_rewards():
    environments = Environments(Door, [])
    multi_turn = make(environments=environments)
    script = Script(["<call>open code=7</call><|end|>", "<call>open code=5</call><|end|>"], ["in<|end|>"] * 2)
    episode = multi_turn.run(rows(7, 8), script, None, "cpu")
    assert episode.prompts[0] == [{"role": "user", "content": "Open. Code 7."}]
    assert "<|user|>Open. Code 7.<|end|>" in script.prompts[0][0] and "tools: open" in script.prompts[0][0]
    doors = episode.reward_kwargs["environments"]
    assert [d.opened for d in doors] == [True, False] and multi_turn.last_environments == doors
    assert environments.reward_funcs[0](environments=doors) == [1.0, 0.0]
    assert [m["content"] for m in episode.completions[0] if m["role"] == "tool"] == ["open"]


def test_a_rollout_funcs_turn_is_continued_by_the_tool_loop_and_its_fields_reach_the_rewards():
    prompt = ids("<|user|>Open.<|end|><|assistant|>")

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [prompt, prompt], "completion_ids": [ids("<call>get</call><|end|>"), ids("x<|end|>")],
                "logprobs": [[0.0] * 6, [0.0] * 2], "judge": ["a", "b"]}

    multi_turn = make([get])
    script = Script(["42<|end|>"])
    episode = multi_turn.run(rows(1, 2), script, lambda p: call_rollout_func(rollout_func, p, None), "cpu")
    assert len(script.prompts) == 1  # the backend only ran the turn after the tool result
    assert episode.reward_kwargs == {"judge": ["a", "b"]}
    assert TOKENIZER.decode(episode.rollout.completion_ids[0]) == "<call>get</call><|end|><|tool|>42<|end|>" \
                                                                  "<|assistant|>42<|end|>"


def test_a_rollout_funcs_env_mask_without_tools_is_the_rounds_env_mask():
    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[5, 6], [7]], "completion_ids": [[8, 9, END], [10]], "logprobs": [[0.0] * 3, [0.0]],
                "env_mask": [[1, 0, 1], [1]]}

    multi_turn = make()
    prompts = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    episode = multi_turn.run([{"prompt": p} for p in prompts], Script(), lambda p: call_rollout_func(
        rollout_func, p, None), "cpu")
    out = episode.rollout
    pad = TOKENIZER.pad_token_id
    assert out.prompt_ids.tolist() == [[5, 6], [pad, 7]] and out.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert out.completion_ids.tolist() == [[8, 9, END], [10, pad, pad]]
    assert out.env_mask.tolist() == [[1, 0, 1], [1, 0, 0]] and out.is_truncated.tolist() == [False, True]
    assert episode.tool_counts is None and episode.completions[0][0]["role"] == "assistant"


def test_text_prompts_are_refused_with_tools():
    multi_turn = make([get])
    with pytest.raises(ValueError, match="text prompts"):
        multi_turn.check_dataset([{"prompt": "plain text"}], "train_dataset")


def test_engine_logps_follow_their_tokens_across_tool_turns():
    # row 1 calls `get`: its completion is turn 1 (engine log-prob -1 per token), the tool result (written by the
    # tool: 0, masked by env_mask) and turn 2 (-2 per token); row 0 ends after turn 1
    multi_turn = make([get])
    episode = multi_turn.run(rows(1, 2), Script(["no<|end|>", "<call>get</call><|end|>"], ["42<|end|>"], engine=True),
                             None, "cpu")
    out = episode.rollout
    first, result, second = len(ids("<call>get</call><|end|>")), len(ids("<|tool|>42<|end|><|assistant|>")), \
        len(ids("42<|end|>"))
    assert out.env_mask[1].tolist()[:first + result + second] == [1] * first + [0] * result + [1] * second
    expected = [-1.0] * first + [0.0] * result + [-2.0] * second
    assert out.sampler.logps[1].tolist()[:len(expected)] == expected
    assert out.sampler.logps[0].tolist()[:3] == [-1.0, -1.0, -1.0] and out.sampler.logps[0, 3:].eq(0).all()
    assert not out.sampler.exact and out.sampler.entropy is None  # tools wrote tokens: no in-process sampler tensor


def test_a_turn_without_engine_logps_leaves_the_rollout_without_any():
    multi_turn = make([get])
    script = Script(["no<|end|>", "<call>get</call><|end|>"], ["42<|end|>"], engine=True, engine_lacks={1})
    assert multi_turn.run(rows(1, 2), script, None, "cpu").rollout.sampler.logps is None


def test_a_rollout_funcs_logprobs_are_the_samplers_with_or_without_vllm():
    """TRL 1.16: a rollout_func's `logprobs` are `sampling_per_token_logps` whatever samples (the off-policy mask
    reads them; the importance-sampling correction, with vLLM only, is gated in the round builder)."""
    def rollout_func(prompts, trainer):
        return {"prompt_ids": [[5, 6], [7]], "completion_ids": [[8, 9, END], [10]],
                "logprobs": [[-0.5, -0.25, -0.125], [-1.0]]}

    prompts = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "user", "content": "b"}]}]
    first_turn = lambda p: call_rollout_func(rollout_func, p, None)  # noqa: E731
    with_vllm = make(use_vllm=True).run(prompts, Script(), first_turn, "cpu").rollout
    assert with_vllm.sampler.logps.tolist() == [[-0.5, -0.25, -0.125], [-1.0, 0.0, 0.0]]
    assert make().run(prompts, Script(), first_turn, "cpu").rollout.sampler.logps.tolist() == \
        [[-0.5, -0.25, -0.125], [-1.0, 0.0, 0.0]]
