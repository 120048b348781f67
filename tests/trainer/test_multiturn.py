"""GRPOTrainer with tools, environments and rollout_func: real tiny-model training runs on both rollout backends,
TRL's set-up errors before any model is loaded, and tool tokens kept out of the loss in every loss type."""

import dataclasses
from collections import defaultdict

import pytest
import torch
from datasets import Dataset

from grpo_trainer import GRPOTrainer
from grpo_trainer.algorithms.losses import LOSS_TYPES
from grpo_trainer.cli.toy import make_tiny_model, make_tokenizer
from grpo_trainer.rollout import BACKENDS, Capabilities, RolloutBackend
from grpo_trainer.rollout.capture import KEEP_NOTHING
from grpo_trainer.trainer.round import Round
from tests.helpers import make_args, make_trainer
from tests.tool_helpers import calling_kwargs, fetch, get

TOKENIZER = make_tokenizer(tool_calling=True)
CALL = TOKENIZER("<call>get</call><|end|>", add_special_tokens=False)["input_ids"]
RESULT = TOKENIZER("<|tool|>42<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
NEVER_LOADED = "a/model-id-that-is-never-downloaded"


def dataset(rows=8):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"secret {i}?"}] for i in range(rows)]})


def alternating(completions, **kwargs):
    """Rewards that differ within every group (so advantages, hence gradients, are not zero)."""
    return [float(i % 2) for i in range(len(completions))]


# One round of G=4 rollouts with room for a call, the tool's result and a second call; the sequence bias of
# `calling_kwargs` makes every turn a call; one round of calls.
SETTINGS = dict(num_generations=4, max_completion_length=32, max_steps=1, learning_rate=1e-2,
                generation_kwargs=calling_kwargs(TOKENIZER), max_tool_calling_iterations=1)


def config(tmp_path, **overrides):
    return make_args(tmp_path, **{**SETTINGS, **overrides})


def trainer(tmp_path, model=None, reward_funcs=alternating, train_dataset=None, **settings):
    return make_trainer(tmp_path, TOKENIZER, dataset() if train_dataset is None else train_dataset, reward_funcs,
                        model, **{**SETTINGS, **settings})


@pytest.mark.parametrize("backend", ["fast", "forward", "generate"])
def test_a_model_calls_a_tool_and_trains_on_every_backend(tmp_path, backend):
    # The sequence bias makes every turn `<call>get</call><|end|>`; with one round of calls allowed each rollout
    # is: call, the tool's result, call again (not run). The tool tokens sit between two sampled turns.
    run = trainer(tmp_path, tools=[get], generation_backend=backend)
    before = {n: p.clone() for n, p in run.model.named_parameters()}
    run.train()
    logged = run.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    assert logged["completions/mean_length"] == 2 * len(CALL)  # sampled tokens only, the tool's are not counted
    (round_,) = run.buffer.parts
    expected = [1] * len(CALL) + [0] * len(RESULT) + [1] * len(CALL)
    assert round_.env_mask.tolist() == [expected] * 4
    assert round_.completion_mask.tolist() == [[1] * len(expected)] * 4  # attended to, all of it
    # Tool tokens were never sampled: the fast backend's sampler values are gone, the loss ran its own forward.
    assert round_.sampler.logps is None and round_.sampler.replay.layer_outputs is None
    assert all(not torch.equal(before[n], p) for n, p in run.model.named_parameters())


def test_tool_rounds_pad_to_a_multiple_like_any_round(tmp_path):
    run = trainer(tmp_path, tools=[get], pad_to_multiple_of=8)
    run.train()
    (round_,) = run.buffer.parts
    assert round_.prompt_ids.shape[1] % 8 == 0 and round_.completion_ids.shape[1] % 8 == 0
    assert round_.env_mask.shape == round_.completion_ids.shape
    assert round_.loss_mask.sum(1).tolist() == [2 * len(CALL)] * 4  # the padding is in no loss either


@pytest.mark.parametrize(("call", "failures"), [("<call>fetch</call><|end|>", 0.0), ("<call>nope</call><|end|>", 1.0)])
def test_async_tools_run_and_failed_calls_are_counted_like_trl(tmp_path, call, failures):
    run = trainer(tmp_path, tools=[fetch, get], generation_kwargs=calling_kwargs(TOKENIZER, call),
                  max_completion_length=200)  # room for the error message of an unknown tool
    run.train()
    logged = run.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == failures
    answer = run.processing_class.decode(run.buffer.parts[0].completion_ids[0])
    assert ("<|tool|>42<|end|>" in answer) == (failures == 0.0) and ("unknown tool 'nope'" in answer) == bool(failures)


class Vault:
    """An environment: `reset` takes the row's code; the tool `get` reveals it; opening is the reward."""

    def reset(self, code: str = "7", **row):
        self.code, self.revealed = code, False
        return " Find the code."

    def get(self) -> str:
        """Reveal the code.

        Returns:
            The code.
        """
        self.revealed = True
        return self.code

    def get_reward(self) -> float:
        return float(self.revealed)


def test_an_environment_owns_the_data_and_the_reward(tmp_path):
    seen = {}

    def reads_the_environments(completions, environments, **kwargs):
        seen["environments"] = environments
        return [0.0] * len(completions)

    run = GRPOTrainer(make_tiny_model(TOKENIZER), reads_the_environments, args=config(tmp_path, max_steps=2),
                      processing_class=TOKENIZER, environment_factory=Vault)
    assert run.reward_func_names == ["reads_the_environments", "Vault"] and run.reward_weights.tolist() == [1, 1]
    assert [t.__name__ for t in run.tools] == ["get"] and len(run._environment_pool[None]) == 1
    assert run.train_dataset["prompt"] == [[{"role": "user", "content": ""}]]  # one round of empty prompts
    run.train()
    assert all(env.revealed for env in run.environments) and seen["environments"] == run.environments
    assert len(run._environment_pool[None]) == 4  # one per rollout, reused across steps
    assert run.state.log_history[0]["rewards/Vault/mean"] == 1.0


def test_a_rollout_func_rollout_trains_with_its_env_mask_and_extra_fields(tmp_path):
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=False)
    judged = {}

    def rollout_func(prompts, trainer):
        judged["trainer"] = trainer
        completion = TOKENIZER("ab<|tool|>x<|end|><|assistant|>c<|end|>", add_special_tokens=False)["input_ids"]
        mask = [1, 1] + [0] * 4 + [1, 1]
        return {"prompt_ids": [prompt] * len(prompts), "completion_ids": [completion] * len(prompts),
                "logprobs": [[0.0] * len(completion)] * len(prompts), "env_mask": [mask] * len(prompts),
                "judge": list(range(len(prompts)))}

    def by_judge(completions, judge, **kwargs):
        return [float(j % 2) for j in judge]

    run = trainer(tmp_path, reward_funcs=by_judge, rollout_func=rollout_func, generation_kwargs=None)
    run.train()
    assert judged["trainer"] is run
    assert run.buffer.parts[0].loss_mask.tolist() == [[1, 1, 0, 0, 0, 0, 1, 1]] * 4
    assert run.state.log_history[0]["completions/mean_length"] == 4 and run.state.log_history[0]["reward"] == 0.5


def test_generate_works_on_a_trainer_assembled_attribute_by_attribute_as_trls_unit_tests_do(tmp_path):
    # TRL's own tests build a trainer with `object.__new__` and assign `_tokenizer` (a plain attribute in TRL):
    # a read-only property there would make that assignment an AttributeError.
    run = trainer(tmp_path, generation_kwargs=None)
    assert run._tokenizer is TOKENIZER
    bare = object.__new__(GRPOTrainer)
    bare._tokenizer, bare.processing_class = TOKENIZER, TOKENIZER
    bare._metrics = {"train": {"num_tokens": [], "completions/mean_length": []}}  # as TRL's tests reset it
    assert bare._metrics["train"]["completions/mean_length"] == [] and bare._metrics["eval"] == {}
    bare.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2, 3]],
                                                  "logprobs": [[-0.1, -0.2]], "env_mask": [[1, 0]]}
    assert bare._generate(["prompt"])[:3] == ([[1]], [[2, 3]], [[1, 0]])  # TRL's order: ids, ids, mask
    bare.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match="rollout_func must return keys"):
        bare._generate(["prompt"])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"reward_funcs": None}, "No reward source provided"),
    ({"train_dataset": None}, "`train_dataset` is required unless an `environment_factory`"),
    ({"environment_factory": {"a": Vault, "b": Vault}, "train_dataset": None}, "requires a `train_dataset`"),
    ({"environment_factory": Vault, "train_dataset": None, "max_steps": -1}, "set `max_steps` > 0"),
    ({"tools": [lambda x: x]}, "tool '<lambda>' cannot be described to the model"),
    ({"tools": get, "environment_factory": Vault}, "tools must be a list of functions, not a function"),
    ({"tools": [get], "train_dataset": Dataset.from_dict({"prompt": ["text"]})}, "text prompts"),
])
def test_bad_multi_turn_set_ups_are_refused_before_any_model_is_loaded(tmp_path, kwargs, message):
    settings = {"reward_funcs": alternating, "train_dataset": dataset(), **kwargs}
    max_steps = settings.pop("max_steps", 1)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GRPOTrainer(NEVER_LOADED, settings.pop("reward_funcs"), args=config(tmp_path, max_steps=max_steps),
                    processing_class=TOKENIZER, **settings)


def test_a_backend_that_cannot_continue_a_rollout_is_refused_with_tools(tmp_path, monkeypatch):
    class SingleTurn(RolloutBackend):
        capabilities = Capabilities(multi_turn=False)

        def generate(self, model, prompts, config, capture=KEEP_NOTHING):
            raise AssertionError("never reached")

    monkeypatch.setitem(BACKENDS, "single_turn", SingleTurn)
    with pytest.raises(ValueError, match="generation_backend='single_turn' cannot continue a rollout"):
        GRPOTrainer(NEVER_LOADED, alternating, args=config(tmp_path, generation_backend="single_turn"),
                    train_dataset=dataset(), processing_class=TOKENIZER, tools=[get])


def test_a_row_naming_an_unknown_environment_fails_the_round(tmp_path):
    rows = Dataset.from_dict({"environment": ["vault", "nowhere"] * 4})
    run = trainer(tmp_path, train_dataset=rows, environment_factory={"vault": Vault}, per_device_train_batch_size=8,
                  num_generations=2)
    # TRL's attributes for a dict of environments: each one's tools, and its pool seeded by the probe instance
    assert [tool.__name__ for tool in run._env_tools["vault"]] == ["get"] and len(run._environment_pool["vault"]) == 1
    with pytest.raises(ValueError, match="environment='nowhere', which is not among the environments"):
        run.train()


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_tool_tokens_contribute_nothing_to_the_trainers_loss_or_gradient(tmp_path, loss_type):
    # The same round scored twice with token-level advantages that differ only on the tool's tokens (env_mask 0):
    # loss and every parameter gradient must be identical. Without the env_mask they differ (the test can fail).
    run = trainer(tmp_path, tools=[get], loss_type=loss_type, epsilon_high=5.0)
    prompt = torch.tensor([TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}],
                                                         add_generation_prompt=True, return_dict=False)] * 2)
    completion = torch.tensor([CALL + RESULT + CALL] * 2)
    env_mask = torch.tensor([[1] * len(CALL) + [0] * len(RESULT) + [1] * len(CALL)] * 2)
    base = Round(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                 completion_mask=torch.ones_like(completion, dtype=torch.int), env_mask=env_mask,
                 advantages=torch.tensor([[1.0] * completion.shape[1], [-0.5] * completion.shape[1]]),
                 window_tokens=env_mask.sum().float())

    def loss_and_grads(round_):
        run.model.zero_grad()
        loss = run.compute_loss(run.model, round_)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in run.model.parameters()]

    run.model.train()
    loss, grads = loss_and_grads(base)
    tool_advantages = base.advantages + 7.0 * (1 - env_mask)  # changed on tool tokens only
    other_loss, other_grads = loss_and_grads(dataclasses.replace(base, advantages=tool_advantages))
    assert torch.equal(loss, other_loss) and all(torch.equal(a, b) for a, b in zip(grads, other_grads))
    unmasked = dataclasses.replace(base, env_mask=None, window_tokens=torch.tensor(float(completion.numel())))
    assert not torch.equal(loss_and_grads(unmasked)[0],
                           loss_and_grads(dataclasses.replace(unmasked, advantages=tool_advantages))[0])


def test_metrics_can_be_reset_by_assignment_and_the_parts_keep_recording(tmp_path):
    # TRL's `_metrics` is a plain attribute: its tests and users' callbacks assign a fresh
    # {"train": defaultdict(list), "eval": defaultdict(list)}. After that assignment the parts must record into the
    # new windows (not a detached old one), or the next log would miss the round's metrics.
    run = trainer(tmp_path, generation_kwargs=None, max_steps=2, logging_steps=1)
    run._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fresh = run._metrics["train"]
    run.metrics.add("train", "reward", 1.0)  # what a part records
    assert fresh["reward"] == [1.0]
    run._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    run.train()
    assert [row["step"] for row in run.state.log_history if "reward" in row] == [1, 2]
