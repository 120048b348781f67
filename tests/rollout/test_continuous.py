"""transformers' continuous-batching backend: selected by `use_transformers_continuous_batching` (and its
deprecated name) over `generation_backend`, `generate`'s greedy tokens, and a real training run through it."""

import inspect

import pytest
import torch
from transformers import generation

from grpo_trainer.config.settings import backend_choice
from grpo_trainer.rollout import BACKENDS, select
from grpo_trainer.rollout.continuous import ContinuousBatchingBackend, continuous_batching_settings
from grpo_trainer.rollout.generate import generate_rollout
from grpo_trainer.rollout.prompts import tokenize_prompts
from tests.helpers import (
    TWO_GROUPS_OF_4,
    assert_same_rollout,
    greedy_config,
    grouped_prompts,
    make_args,
    make_trainer,
    model_of_kind,
)

# A small paged cache: the engine otherwise sizes it from free memory, which on a CPU machine is most of its RAM.
# (`page_size` is transformers 5.18's name for what 5.17 and older call `block_size`.)
_FIELDS = inspect.signature(generation.ContinuousBatchingConfig).parameters \
    if hasattr(generation, "ContinuousBatchingConfig") else {}
SMALL = {"num_blocks": 16, "page_size" if "page_size" in _FIELDS else "block_size": 32, "max_batch_tokens": 256}
SETTINGS = dict(**TWO_GROUPS_OF_4, transformers_continuous_batching_config=SMALL)


def test_the_flag_selects_it_over_generation_backend_and_the_old_name_too(tmp_path):
    def selected(**fields):
        return select(backend_choice(make_args(tmp_path, **SETTINGS, **fields)))

    assert isinstance(selected(use_transformers_continuous_batching=True), ContinuousBatchingBackend)
    assert isinstance(selected(use_transformers_continuous_batching=True, generation_backend="generate"),
                      ContinuousBatchingBackend)
    with pytest.warns(FutureWarning, match="use_transformers_paged is deprecated"):
        args = make_args(tmp_path, **SETTINGS, use_transformers_paged=True)
    assert isinstance(select(backend_choice(args)), ContinuousBatchingBackend)
    args = make_args(tmp_path, **SETTINGS)
    args.use_transformers_paged = True  # set after construction, as scripts do
    assert isinstance(select(backend_choice(args)), ContinuousBatchingBackend)
    assert not isinstance(selected(), ContinuousBatchingBackend)


def test_its_settings_get_trls_memory_default_and_are_checked_early():
    assert continuous_batching_settings(None) == {"max_memory_percent": 0.5}
    assert continuous_batching_settings('{"num_blocks": 4, "max_memory_percent": 0.2}') == {
        "num_blocks": 4, "max_memory_percent": 0.2}  # the command line's JSON
    with pytest.raises(TypeError, match="no_such_setting"):
        ContinuousBatchingBackend({"no_such_setting": 1})


def test_capabilities_are_tokens_only():
    capabilities = BACKENDS["transformers_continuous_batching"].capabilities
    assert not (capabilities.sampling_logps or capabilities.layer_outputs or capabilities.sampling_probs)
    assert not capabilities.logits_processors


def test_greedy_tokens_equal_generate(tokenizer):
    """Prompts of different lengths (the engine takes them unpadded), rows that end at an EOS and rows that run to
    the length limit; the model's training mode is left as it was."""
    model = model_of_kind("qwen2", tokenizer).train()
    prompts = grouped_prompts(tokenizer)
    with torch.no_grad():
        free = generate_rollout(model, prompts, greedy_config(tokenizer))
    config = greedy_config(tokenizer, eos_token_id=[tokenizer.eos_token_id, free.completion_ids[0, 3].item()])
    with torch.no_grad():
        reference = generate_rollout(model, prompts, config)
    assert reference.completion_mask.sum(1).min() < reference.completion_ids.shape[1]  # some rows end early
    assert reference.is_truncated.any()  # and some do not
    rollout = ContinuousBatchingBackend(SMALL).generate(model, prompts, config)
    assert_same_rollout(rollout, reference)
    assert model.training


def test_sampling_follows_torchs_seed(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    prompts = tokenize_prompts(tokenizer, ["copy 12:"] * 8, None)
    config = greedy_config(tokenizer, do_sample=True, top_k=None)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(ContinuousBatchingBackend(SMALL).generate(model, prompts, config).completion_ids)
    assert torch.equal(runs[0], runs[1]) and len({tuple(r) for r in runs[0].tolist()}) > 1


def test_a_training_run_through_it(tmp_path, tokenizer, toy_dataset):
    trainer = make_trainer(tmp_path, tokenizer, toy_dataset, model=model_of_kind("qwen2", tokenizer), **SETTINGS,
                           use_transformers_continuous_batching=True)
    assert isinstance(trainer.rollout_backend, ContinuousBatchingBackend)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    logged = trainer.state.log_history[0]
    assert "completions/mean_length" in logged and "reward" in logged and logged["completions/max_length"] <= 6
