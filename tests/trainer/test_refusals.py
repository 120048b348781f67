"""The trainer's refusals of combinations it cannot run stop it by name (the settings and the fix) before any weights
load: sequence parallelism's (`trainer.sequence_group.REFUSALS`), the asynchronous round source's
(`trainer.producer.REFUSALS`, `AsyncRounds.check`) and a vision-language processor's (`setup.check_processor_setup`).

How "before any weights load" is shown: the model is given as a local directory holding a real tiny checkpoint, and
`loads` records every call of the project's loader (`runtime.models.load_policy`) and of transformers'
`PreTrainedModel.from_pretrained` (which every `AutoModel*` load ends in), and stops the latter with `WeightsLoaded`
(not a ValueError, so it can never pass for a refusal). A refusal test asserts its message and that nothing was
recorded; each case's control applies the fix its message names and shows the same construction then goes on to
load the weights, so the watch is on the path the trainer really takes, and the refusal is what stopped it.

The launch is built the way `config.settings.launch` reads it, without starting processes: the world size through
`TrainingArguments.world_size` (patched: setting `WORLD_SIZE` would make accelerate start a process group), a
DeepSpeed config as `args.deepspeed` (a dict) or as the variables `accelerate launch` exports, FSDP as
`ACCELERATE_USE_FSDP`. vLLM is not installed here and need not be: these refusals fire before a backend is built.

The packing refusal of `modeling.forwards` (a forward without `position_ids`) is no stop: it is decided per call on a
loaded model and falls back to the padded forward; its tests are at the end.
"""

import logging

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedModel, Qwen2ForCausalLM

from grpo_trainer import GRPOConfig
from grpo_trainer.cli.toy import copy_digits_dataset, make_tiny_model
from grpo_trainer.modeling import forwards
from grpo_trainer.runtime import models
from tests.helpers import make_args, make_trainer


class WeightsLoaded(Exception):
    """Raised by `loads` in place of a weight load."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer) -> str:
    """A tiny Qwen2 checkpoint (config, safetensors weights, tokenizer) in a local directory."""
    folder = tmp_path_factory.mktemp("policy")
    make_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Every weight load the trainer attempts, in order; the first `from_pretrained` raises `WeightsLoaded`."""
    seen: list[str] = []
    load_policy = models.load_policy

    def watched_load_policy(model, *args, **kwargs):
        seen.append(f"load_policy({model})")
        return load_policy(model, *args, **kwargs)

    def from_pretrained(cls, name, *args, **kwargs):
        seen.append(f"{cls.__name__}.from_pretrained({name})")
        raise WeightsLoaded(seen[-1])

    monkeypatch.setattr(models, "load_policy", watched_load_policy)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    return seen


def llava_processor():
    """A vision-language processor (the tiny LLaVA's), built offline."""
    from tests.toy_vlm import VLM_FAMILIES

    return VLM_FAMILIES["llava"]()[1]


def build(tmp_path, monkeypatch, tokenizer, checkpoint, *, processes=1, deepspeed=None, env=None, processor=None,
          dataset=None, rollout_func=None, **fields):
    """A trainer on the model at `checkpoint` (a path: nothing loaded yet) under a launch of `processes` processes
    with `deepspeed` (the `args.deepspeed` dict) and the launcher's `env`, and `fields` over the tests' defaults."""
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: processes))
    args = make_args(tmp_path, **fields)
    # After the config is built: TrainingArguments would set up DeepSpeed's engine config, or accelerate a
    # distributed state, at construction; `config.settings.launch` reads both when the trainer is built.
    args.deepspeed = deepspeed
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return make_trainer(tmp_path, processor or tokenizer, dataset, model=checkpoint, args=args,
                        rollout_func=rollout_func)


def assert_refused(error, *parts: str) -> None:
    message = str(error.value)
    assert all(part in message for part in parts), message


def assert_reaches_the_weights(loads, checkpoint, run) -> None:
    """`run()` gets as far as loading the policy's weights from `checkpoint` (where the watch stops it)."""
    with pytest.raises(WeightsLoaded):
        run()
    assert loads == [f"load_policy({checkpoint})", f"Qwen2ForCausalLM.from_pretrained({checkpoint})"]


class EngineBuilt(Exception):
    """Raised in place of building the vLLM backend (its first step: the install check)."""


def assert_reaches_the_engine(loads, monkeypatch, run) -> None:
    """`run()` (a vLLM run) gets past every refusal to building its backend, where the watch stops it: whether vLLM
    is installed, or a server is up, is then the next question, not a refusal's."""
    from grpo_trainer.rollout.vllm import checks

    def built():
        raise EngineBuilt

    monkeypatch.setattr(checks, "check_installed", built)
    with pytest.raises(EngineBuilt):
        run()
    assert loads == []


# ---------------------------------------------------------------------------------------------------------------------
# Sequence parallelism: parallelism_config sp_size=2 on 2 processes (`trainer.sequence_group.REFUSALS`)

ZERO_2 = {"zero_optimization": {"stage": 2}}
SP = "parallelism_config sp_size=2 (DeepSpeed Ulysses sequence parallelism, docs/DISTRIBUTED.md) does not combine with"

# case -> (the refused settings, the fix its message names, what the message says, the fix as the message words it)
SEQUENCE_PARALLEL_CASES = {
    "deepspeed": ({"deepspeed": ZERO_2}, {}, "DeepSpeed (only DDP is wired)",
                  "launch with accelerate_configs/cpu/ddp_sp.yaml"),
    "deepspeed_launcher_env": ({"env": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}},
                               {}, "DeepSpeed (only DDP is wired)", "launch with accelerate_configs/cpu/ddp_sp.yaml"),
    "fsdp": ({"env": {"ACCELERATE_USE_FSDP": "true"}}, {}, "FSDP (only DDP is wired)",
             "launch with accelerate_configs/cpu/ddp_sp.yaml"),
    "vllm": ({"use_vllm": True}, {"use_vllm": False}, "use_vllm=True (untested)", "set use_vllm=False"),
    "routing_replay": ({"routing_replay": "on"}, {"routing_replay": "off"},
                       "routing_replay='on' (the sharded forward does not replay routes)", "set routing_replay='off'"),
    "vision": ({"processor": "llava"}, {"processor": "llava", "parallelism_config": None},
               "a vision-language model's processor (image inputs; untested)", "set sp_size=1"),
}


def _sequence_parallel(case: str, fixed: bool) -> dict:
    from accelerate.parallelism_config import ParallelismConfig

    refused, fix, _, _ = SEQUENCE_PARALLEL_CASES[case]
    settings = {"processes": 2, "parallelism_config": ParallelismConfig(sp_size=2), **refused}
    if fixed:  # the fix the message names: without the refused setting (or without sp_size)
        settings = {k: v for k, v in settings.items() if k not in refused} | fix
    if settings.get("processor") == "llava":
        settings["processor"] = llava_processor()
    return settings


@pytest.mark.parametrize("case", list(SEQUENCE_PARALLEL_CASES))
def test_sequence_parallelism_refuses_before_any_weights_load(case, tmp_path, monkeypatch, tokenizer, checkpoint,
                                                              loads):
    _, _, what, fix = SEQUENCE_PARALLEL_CASES[case]
    with pytest.raises(ValueError) as error:
        build(tmp_path, monkeypatch, tokenizer, checkpoint, **_sequence_parallel(case, fixed=False))
    assert_refused(error, f"{SP} {what}", fix)
    assert loads == []


@pytest.mark.parametrize("case", list(SEQUENCE_PARALLEL_CASES))
def test_sequence_parallelism_with_its_fix_goes_on_to_load(case, tmp_path, monkeypatch, tokenizer, checkpoint, loads):
    settings = _sequence_parallel(case, fixed=True)
    assert_reaches_the_weights(loads, checkpoint, lambda: build(tmp_path, monkeypatch, tokenizer, checkpoint,
                                                                **settings))


# ---------------------------------------------------------------------------------------------------------------------
# Asynchronous rollouts (`trainer.producer.REFUSALS`, `AsyncRounds.check`)

ZERO_3 = {"zero_optimization": {"stage": 3}}
COLOCATED_TP = {"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2}
IN_PROCESS_SHARDED = ("an in-process backend samples from the live weights on a second thread, which {} shards "
                      "(gathering them is a collective); use a vLLM server (use_vllm=True, vllm_mode='server'), DDP or "
                      "ZeRO-2, or async_rollouts=0")

# case -> (the refused settings, the fix, what the message says after "async_rollouts=1 is not supported here: ")
ASYNC_CASES = {
    "colocated_tensor_parallel": (COLOCATED_TP, {"vllm_tensor_parallel_size": 1},
                                  "tensor-parallel colocated vLLM generates through a collective; use "
                                  "vllm_tensor_parallel_size=1 or a vLLM server"),
    "zero3_fast": ({"processes": 2, "deepspeed": ZERO_3, "generation_backend": "fast"}, {"deepspeed": ZERO_2},
                   IN_PROCESS_SHARDED.format("DeepSpeed ZeRO-3")),
    "zero3_generate": ({"processes": 2, "deepspeed": ZERO_3, "generation_backend": "generate"}, {"deepspeed": ZERO_2},
                       IN_PROCESS_SHARDED.format("DeepSpeed ZeRO-3")),
    "zero3_launcher_env_fast": ({"processes": 2, "generation_backend": "fast",
                                 "env": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}},
                                {"env": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}},
                                IN_PROCESS_SHARDED.format("DeepSpeed ZeRO-3")),
    "fsdp_fast": ({"processes": 2, "generation_backend": "fast", "env": {"ACCELERATE_USE_FSDP": "true"}},
                  {"env": {}}, IN_PROCESS_SHARDED.format("FSDP")),
    "fsdp_generate": ({"processes": 2, "generation_backend": "generate", "env": {"ACCELERATE_USE_FSDP": "true"}},
                      {"env": {}}, IN_PROCESS_SHARDED.format("FSDP")),
    # The table's other rows, through the trainer too
    "rollout_func": ({"rollout_func": lambda prompts, trainer: None}, {"rollout_func": None},
                     "a rollout_func receives the trainer, which the producer thread would share with the training "
                     "step; use tools or environment_factory, or async_rollouts=0"),
    "streamed": ({"dataset": "streamed", "max_steps": 2}, {"dataset": None},
                 "a streamed train_dataset cannot be read rounds ahead; pass a map-style datasets.Dataset, or "
                 "async_rollouts=0"),
    "continuous_batching": ({"use_transformers_continuous_batching": True},
                            {"use_transformers_continuous_batching": False},
                            "transformers' continuous batching switches the model between train and eval mode while "
                            "it generates; use generation_backend='fast' or 'generate'"),
    "server_processes": ({"processes": 2, "use_vllm": True, "vllm_mode": "server"}, {"vllm_mode": "colocate"},
                         "with several training processes the main process's client serves every process's prompts"),
    "engine_mismatch_report": ({"use_vllm": True, "sampling_mismatch_report": True},
                               {"sampling_mismatch_report": False},
                               "sampling_mismatch_report compares the sampler's log-probs with the trainer's"),
}


def _asynchronous(case: str, fixed: bool) -> dict:
    refused, fix, _ = ASYNC_CASES[case]
    settings = {"async_rollouts": 1, "disable_dropout": True, **refused, **(fix if fixed else {})}
    if settings.get("dataset") == "streamed":
        settings["dataset"] = copy_digits_dataset(num_prompts=32).to_iterable_dataset()
    return settings


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_rollouts_refuse_before_any_weights_load(case, tmp_path, monkeypatch, tokenizer, checkpoint, loads):
    *_, what = ASYNC_CASES[case]
    with pytest.raises(ValueError) as error:
        build(tmp_path, monkeypatch, tokenizer, checkpoint, **_asynchronous(case, fixed=False))
    assert_refused(error, f"async_rollouts=1 is not supported here: {what}")
    assert loads == []


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_rollouts_with_the_fix_go_on_to_load(case, tmp_path, monkeypatch, tokenizer, checkpoint, loads):
    """With the fix, a run on an in-process backend loads the weights; a vLLM run gets to building its backend
    (`rollout.select`, the step after the refusals, before the weights load)."""
    settings = _asynchronous(case, fixed=True)

    def run():
        return build(tmp_path, monkeypatch, tokenizer, checkpoint, **settings)

    if settings.get("use_vllm"):
        assert_reaches_the_engine(loads, monkeypatch, run)
    else:
        assert_reaches_the_weights(loads, checkpoint, run)


# ---------------------------------------------------------------------------------------------------------------------
# A vision-language processor (`setup.check_processor_setup`)


def test_continuous_batching_with_a_processor_refuses_before_any_weights_load(tmp_path, monkeypatch, tokenizer,
                                                                              checkpoint, loads):
    with pytest.raises(ValueError) as error:
        build(tmp_path, monkeypatch, tokenizer, checkpoint, processor=llava_processor(),
              use_transformers_continuous_batching=True)
    assert_refused(error, "`use_transformers_continuous_batching` does not support multimodal models. Use "
                          "generation_backend='generate'")
    assert loads == []
    assert_reaches_the_weights(loads, checkpoint, lambda: build(
        tmp_path, monkeypatch, tokenizer, checkpoint, processor=llava_processor(), generation_backend="generate"))


# ---------------------------------------------------------------------------------------------------------------------
# Packing (`padding_free=True`) and a forward without `position_ids` (`modeling.forwards.REFUSALS`)


class NoPositionsLM(Qwen2ForCausalLM):
    """A causal LM whose forward takes no `position_ids` (and no **kwargs): positions come from the mask alone."""

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, use_cache=None,
                output_hidden_states=None, logits_to_keep=0):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                               inputs_embeds=inputs_embeds, use_cache=use_cache,
                               output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)


@pytest.fixture
def no_positions_model(tokenizer):
    base = make_tiny_model(tokenizer)
    model = NoPositionsLM(base.config)
    model.load_state_dict(base.state_dict())
    forwards._VERDICTS.pop(model, None)
    forwards._LOGGED.pop(model, None)
    return model


def left_padded_batch():
    """4 rows of 10 tokens, the first with 3 columns of left padding; 4 completion tokens."""
    ids = torch.randint(10, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask, 4


def test_packing_refuses_a_forward_without_position_ids_by_name(no_positions_model, monkeypatch, caplog):
    """padding_free=True: such a model is never packed, nor self-checked (its packed positions could not restart per
    sequence); the call is scored padded, and the log names padding_free, the model and the reason. The decision
    reads the loaded model's forward, per call: it is a fallback, not a stop, and cannot precede the load."""
    reason = "its forward takes no position_ids, so positions cannot restart per sequence"
    assert forwards.refusal(no_positions_model, forwards.Call()) == reason

    def never(*args, **kwargs):
        raise AssertionError("packed or self-checked")

    padded = []
    monkeypatch.setattr(forwards, "self_check", never)
    monkeypatch.setattr(forwards, "packed_logprobs", never)
    monkeypatch.setattr(forwards, "completion_logprobs", lambda model, *args, **kwargs: padded.append(model))
    ids, mask, T = left_padded_batch()
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.modeling.forwards"):
        forwards.score(no_positions_model, ids, mask, T, forwards.ForwardSettings(padding_free=True))
    assert padded == [no_positions_model]
    assert f"padding_free: NoPositionsLM is scored padded: {reason}." in caplog.text


def test_a_forward_without_position_ids_is_scored_padded(no_positions_model):
    """The padded forward the packing refusal falls back to passes no `position_ids` to a forward that takes none
    (it used to, and such a model failed with a TypeError whatever `padding_free` said)."""
    ids, mask, T = left_padded_batch()
    scored = forwards.score(no_positions_model, ids, mask, T, forwards.ForwardSettings(padding_free=True))
    assert scored.logps.shape == (4, T)


def test_the_watch_sees_the_trainers_load(tmp_path, monkeypatch, tokenizer, checkpoint, loads):
    """The control of every test above on its own: a plain run from the checkpoint loads the policy through the
    watched loader and transformers' from_pretrained, once the checks have passed."""
    assert_reaches_the_weights(loads, checkpoint, lambda: build(tmp_path, monkeypatch, tokenizer, checkpoint,
                                                                dataset=Dataset.from_dict({"prompt": ["copy 1:"] * 8})))
