"""The shared-prefix path on the model's own forward: `generate`'s greedy tokens for architectures the decoder does
not serve, each distinct prompt prefilled once, the sampling log-probs the loss computes (or none where the model's
logits are not its head's output), and `generate` for what it does not serve."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.rollout import BACKENDS, Capture
from grpo_trainer.rollout.fast import backend as fast_backend
from grpo_trainer.rollout.fast import forward, guard
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import (
    MAX_NEW,
    assert_same_rollout,
    fast_path_blocker,
    fast_rollout,
    fresh_copy,
    greedy_config,
    grouped_prompts,
    model_of_kind,
)

ARCHITECTURES = {
    "gpt2_no_dropout": {},  # learned absolute positions, fused c_attn, LayerNorm, GELU
    # alternating sliding (4) / global layers, soft-capped attention and logits, (1 + w) norms; an untied head
    # (tied, this tiny model repeats one token)
    "gemma2": {"tie_word_embeddings": False},
    "phi3": {},  # fused qkv and gate|up projections
    "mixtral": {},  # a mixture of experts
    "mistral": {"sliding_window": 8},  # a window shorter than prompt + completion
    "llama": {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}, "max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_greedy_tokens_equal_generate(tokenizer, kind):
    model = model_of_kind(kind, tokenizer, initializer_range=0.1, **ARCHITECTURES[kind])
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer, max_new_tokens=MAX_NEW + 8)
    assert fast_path_blocker(model, config, prompts.ids.shape[1]) is not None  # not the decoder's
    assert forward.forward_blocker(model) is None
    with torch.no_grad():
        reference = generate_rollout(fresh_copy(model), prompts, config)
    assert reference.completion_ids.shape[1] == MAX_NEW + 8  # nothing ended early: every position compared
    assert_same_rollout(BACKENDS["forward"]().generate(fresh_copy(model), prompts, config), reference)
    assert_same_rollout(fast_rollout(model, prompts, config), reference)  # the fast backend's tier for it


def test_each_distinct_prompt_is_prefilled_once(tokenizer):
    model = model_of_kind("phi3", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)  # 3 prompts x 4 rows
    rows = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    BACKENDS["forward"]().generate(model, prompts, greedy_config(tokenizer, max_new_tokens=3))
    hook.remove()
    assert rows == [(3, prompts.ids.shape[1]), (12, 1), (12, 1)]  # prefill of 3 prompts, then 12 rows a token each


@pytest.mark.parametrize("kind", ["phi3", "gpt2_no_dropout"])
def test_sampling_logps_and_probs_are_the_training_forwards(tokenizer, kind):
    model = model_of_kind(kind, tokenizer)
    prompts = grouped_prompts(tokenizer)
    torch.manual_seed(0)
    rollout = BACKENDS["forward"]().generate(model, prompts, greedy_config(tokenizer, do_sample=True, top_k=5,
                                                                            temperature=0.7), Capture(probs=True))
    ids = torch.cat([prompts.ids, rollout.completion_ids], 1)
    mask = torch.cat([prompts.mask, rollout.completion_mask], 1)
    with torch.no_grad():
        out = completion_logprobs(model, ids, mask, rollout.completion_ids.shape[1], temperature=0.7,
                                  with_entropy=True)
    logps, entropy = out.logps, out.entropy
    active = rollout.completion_mask.bool()
    torch.testing.assert_close(rollout.sampler.logps[active], logps[active], atol=1e-5, rtol=0)
    torch.testing.assert_close(rollout.sampler.entropy[active], entropy[active], atol=1e-5, rtol=0)
    chosen = rollout.sampler.replay.probs.gather(2, rollout.completion_ids[..., None]).squeeze(2)
    torch.testing.assert_close(chosen.log()[active], logps[active], atol=1e-5, rtol=0)


def test_soft_capped_logits_keep_no_log_probs(tokenizer):
    """Gemma-2's logits are tanh-capped after its head; the loss scores the head's output, so the rollout's
    log-probs would not be the loss's and are left to the trainer."""
    model = model_of_kind("gemma2", tokenizer)
    rollout = BACKENDS["forward"]().generate(model, grouped_prompts(tokenizer), greedy_config(tokenizer,
                                                                                              do_sample=True))
    assert rollout.sampler.logps is None and rollout.sampler.entropy is None and rollout.sampler.replay.probs is None
    uncapped = model_of_kind("gemma2", tokenizer, final_logit_softcapping=None)
    rollout = BACKENDS["forward"]().generate(uncapped, grouped_prompts(tokenizer), greedy_config(tokenizer,
                                                                                                 do_sample=True))
    assert rollout.sampler.logps is not None


def test_capabilities_are_what_it_keeps():
    capabilities = BACKENDS["forward"].capabilities
    assert capabilities.sampling_logps and capabilities.sampling_probs and not capabilities.layer_outputs


def test_what_it_does_not_serve_goes_to_generate(tokenizer):
    config = Qwen3NextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # transformers >= 5.13 builds its dynamic cache with linear-attention layers; before, the model kept its own
    assert forward.forward_blocker(model) in ("recurrent or linear-attention layers",
                                              "Qwen3NextForCausalLM keeps a cache of its own")
    prompts = grouped_prompts(tokenizer)
    with torch.no_grad():
        reference = generate_rollout(model, prompts, greedy_config(tokenizer, max_new_tokens=3))
    assert_same_rollout(BACKENDS["forward"]().generate(model, prompts, greedy_config(tokenizer, max_new_tokens=3)),
                        reference)
    beams = greedy_config(tokenizer, num_beams=2)
    assert "beam_search" in guard.settings_blocker(model_of_kind("phi3", tokenizer), beams, 11)


@pytest.mark.parametrize("change", ["removed", "renamed_parameter"])
def test_a_changed_generation_helper_sends_the_rollout_to_generate_with_the_reason(tokenizer, monkeypatch, caplog,
                                                                                     change):
    """Decision 4: the tier drives private generation helpers; when transformers drops one or renames a parameter
    it passes (here `_update_model_kwargs_for_generation`, and `next_sequence_length` of
    `prepare_inputs_for_generation`), the fast backend samples with `generate` instead, logging which helper."""
    from transformers.generation.utils import GenerationMixin

    model = model_of_kind("phi3", tokenizer)  # an architecture the decoder refuses: the forward tier's
    if change == "removed":
        monkeypatch.delattr(GenerationMixin, "_update_model_kwargs_for_generation")
        expected = "has no _update_model_kwargs_for_generation"
    else:
        original = GenerationMixin.prepare_inputs_for_generation

        def renamed(self, input_ids, new_tokens=None, cache=None, attention_mask=None, is_first_iteration=False,
                    **kwargs):
            new_tokens = kwargs.pop("next_sequence_length", new_tokens)  # generate's own call still passes it
            return original(self, input_ids, next_sequence_length=new_tokens, cache=cache,
                            attention_mask=attention_mask, is_first_iteration=is_first_iteration, **kwargs)

        monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", renamed)
        expected = "prepare_inputs_for_generation no longer takes ['next_sequence_length']"
    assert expected in forward.forward_blocker(model)
    prompts, config = grouped_prompts(tokenizer), greedy_config(tokenizer)
    if change == "removed":  # `generate` needs the removed helper too: record the hand-off instead of running it
        handed = []
        monkeypatch.setattr(fast_backend, "generate_rollout", lambda *args: handed.append(args) or "generate's")
    with torch.no_grad(), caplog.at_level("INFO", logger="grpo_trainer.rollout.fast.backend"):
        served = fast_rollout(model, prompts, config)
        reference = generate_rollout(model, prompts, config) if change == "renamed_parameter" else None
    assert "falls back to model.generate" in caplog.text and expected in caplog.text
    if reference is not None:  # generate itself still runs through the (renamed) helper
        assert_same_rollout(served, reference)
    else:
        assert served == "generate's" and len(handed) == 1
