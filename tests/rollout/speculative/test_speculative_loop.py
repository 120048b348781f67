"""Speculative rollouts over the fast decoder (`rollout.speculative.loop`): greedy completions token-identical to
the plain loop across the decoder's families; sampled, the same tokens with drafts as without for the same seed
(each position reads its own uniforms), so drafting changes the forward count only; every value kept of a token
from the forward that drew it, equal to a plain forward's; the plain loop's stopping rules at the same positions."""

import logging

import pytest
import torch

from grpo_trainer.rollout.capture import Capture
from grpo_trainer.rollout.fast.backend import FastBackend
from grpo_trainer.rollout.fast.loop import NonFiniteLogitsError
from grpo_trainer.rollout.speculative.settings import SpeculativeSettings
from tests.helpers import assert_same_rollout, greedy_config, grouped_prompts, model_of_kind

ON = SpeculativeSettings()  # policy "fixed": forward counts reproduce (no timings)
NO_DRAFTS = SpeculativeSettings(max_verify_tokens=1, policy="fixed")  # one position per row per forward: never a draft


def _rollout(model, prompts, config, settings, seed=0, **capture):
    torch.manual_seed(seed)
    return FastBackend(cuda="decoder", speculative=settings).generate(model, prompts, config, Capture(**capture))


def _plain(model, prompts, config, seed=0, **capture):
    torch.manual_seed(seed)
    return FastBackend(cuda="decoder").generate(model, prompts, config, Capture(**capture))


def _valid(rollout):
    return rollout.completion_mask.bool()


def _lora(tokenizer):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model_of_kind("qwen2", tokenizer), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3", "mistral", "llama3", "qwen2.5-0.5b", "lora"])
def test_greedy_completions_equal_the_plain_loop(tokenizer, kind):
    """GQA (all), tied embeddings (qwen2, the 0.5B layout), q/k norms (qwen3), biased projections (llama), llama3
    RoPE, a window longer than the rollout (mistral), a LoRA adapter merged into the fused weights."""
    model = _lora(tokenizer) if kind == "lora" else model_of_kind(kind, tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, max_new_tokens=40)
    plain, spec = _plain(model, prompts, config), _rollout(model, prompts, config, ON)
    assert_same_rollout(spec, plain)
    valid = _valid(plain)
    torch.testing.assert_close(spec.sampler.logps[valid], plain.sampler.logps[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(spec.sampler.entropy[valid], plain.sampler.entropy[valid], atol=1e-5, rtol=0)
    counts = spec.decode
    assert counts.accepted > 0 and counts.forwards < plain.completion_ids.shape[1] - 1  # drafts held: fewer forwards
    assert counts.generated == int(plain.completion_mask.sum())  # every row's tokens up to its EOS, and no more
    assert plain.decode is None


@pytest.mark.parametrize("sampling", [dict(temperature=0.5), dict(temperature=1.0, top_k=4, top_p=0.9)])
def test_sampled_tokens_and_everything_kept_are_the_same_with_drafts_as_without(tokenizer, sampling):
    """With a seed, drafts change how many forwards a round takes and nothing it samples or keeps: tokens,
    log-probs, entropies, the kept supports and their mass, the softmax and every layer's output for replay."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, max_new_tokens=30, do_sample=True, **sampling)
    capture = dict(probs=True, layer_outputs=True, kept_support=True)
    spec, none = _rollout(model, prompts, config, ON, **capture), _rollout(model, prompts, config, NO_DRAFTS, **capture)
    assert spec.decode.accepted > 0 and none.decode.drafted == 0  # the comparison is between two different paths
    assert spec.decode.row_forwards < none.decode.row_forwards  # some tokens committed from drafts
    assert_same_rollout(spec, none)
    valid = _valid(none)
    for name in ("logps", "entropy"):
        torch.testing.assert_close(getattr(spec.sampler, name)[valid], getattr(none.sampler, name)[valid],
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(spec.sampler.replay.probs[valid], none.sampler.replay.probs[valid], atol=1e-6, rtol=0)
    # every fed column: the prompt's, and each completion token that another token of its row followed
    ones = torch.ones_like(valid[:, :1])
    fed = torch.cat([ones.expand_as(prompts.mask), valid[:, 1:], ~ones], 1)  # [B, S + T]
    outputs_spec, outputs_none = (r.sampler.replay.layer_outputs.transpose(1, 2) for r in (spec, none))
    torch.testing.assert_close(outputs_spec[fed], outputs_none[fed], atol=1e-5, rtol=0)
    if "top_k" in sampling:
        kept_spec, kept_none = spec.sampler.kept, none.sampler.kept
        assert torch.equal(kept_spec.mask[valid], kept_none.mask[valid])
        torch.testing.assert_close(kept_spec.log_mass[valid], kept_none.log_mass[valid], atol=1e-5, rtol=0)
        torch.testing.assert_close(kept_spec.drawn_logps[valid], kept_none.drawn_logps[valid], atol=1e-5, rtol=0)


def test_recorded_logps_equal_a_plain_forward(tokenizer):
    model = model_of_kind("qwen3", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, max_new_tokens=30, do_sample=True, temperature=0.7)
    spec = _rollout(model, prompts, config, ON)
    assert spec.decode.accepted > 0
    ids = torch.cat([spec.prompt_ids, spec.completion_ids], 1)
    mask = torch.cat([spec.prompt_mask, spec.completion_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    S, T = spec.prompt_ids.shape[1], spec.completion_ids.shape[1]
    expected = torch.log_softmax(logits[:, S - 1:S + T - 1] / 0.7, -1).gather(2, spec.completion_ids[..., None])[..., 0]
    valid = _valid(spec)
    torch.testing.assert_close(spec.sampler.logps[valid], expected[valid], atol=1e-6, rtol=1e-6)


def test_seeded_rollouts_reproduce_and_other_seeds_differ(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, max_new_tokens=20, do_sample=True)
    first, again = _rollout(model, prompts, config, ON, seed=3), _rollout(model, prompts, config, ON, seed=3)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.sampler.logps, again.sampler.logps)
    assert first.decode == again.decode
    assert not torch.equal(first.completion_ids, _rollout(model, prompts, config, ON, seed=4).completion_ids)


@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_the_length_cap_and_eos_hold_at_the_plain_loops_positions(tokenizer, max_new):
    model = model_of_kind("llama", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, max_new_tokens=max_new)
    spec, plain = _rollout(model, prompts, config, ON), _plain(model, prompts, config)
    assert_same_rollout(spec, plain)
    assert spec.completion_ids.shape[1] <= max_new


def test_an_eos_inside_an_accepted_draft_ends_the_row_there(tokenizer):
    """The second round of the same prompts drafts the first round's completions, EOS included: rows end inside
    accepted drafts, where the plain loop ends them. (The EOS is a token greedy decoding emits mid-completion.)"""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=2)
    free = _plain(model, prompts, greedy_config(tokenizer, max_new_tokens=40)).completion_ids
    config = greedy_config(tokenizer, max_new_tokens=40, eos_token_id=[free[0, 6].item()])
    plain = _plain(model, prompts, config)
    assert not bool(plain.is_truncated[0])  # row 0 ends with that EOS
    backend = FastBackend(cuda="decoder", speculative=ON)
    first, second = backend.generate(model, prompts, config), backend.generate(model, prompts, config)
    assert_same_rollout(first, plain)
    assert_same_rollout(second, plain)
    assert second.decode.forwards < first.decode.forwards


def test_nan_logits_stop_the_rollout_with_the_plain_loops_message(tokenizer):
    model = model_of_kind("qwen2", tokenizer)
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")
    config = greedy_config(tokenizer, do_sample=True)
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf logits at completion token 0 in 12 of 12 rows"):
        _rollout(model, grouped_prompts(tokenizer, repeats=4), config, ON)


def test_a_later_token_with_nan_logits_is_named(tokenizer):
    model = model_of_kind("llama", tokenizer)  # untied head: only the embedding row is broken
    prompts = grouped_prompts(tokenizer, repeats=4)
    free = _plain(model, prompts, greedy_config(tokenizer)).completion_ids
    token = free[0, 1].item()
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf logits at completion token 2 "):
        _rollout(model, prompts, greedy_config(tokenizer), ON)


def test_earlier_rounds_draft_a_prompts_later_completions(tokenizer):
    """One completion per prompt: no sibling to draft from in the first round; the second round of the same
    prompts drafts from the first's completions ("history") and takes fewer forwards for the same tokens."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=1)
    config = greedy_config(tokenizer, max_new_tokens=40)
    backend = FastBackend(cuda="decoder", speculative=SpeculativeSettings(sources=("group", "history"), policy="fixed"))
    first, second = backend.generate(model, prompts, config), backend.generate(model, prompts, config)
    assert_same_rollout(second, first)
    assert second.decode.accepted > first.decode.accepted
    assert second.decode.forwards < first.decode.forwards


@pytest.mark.parametrize("processor", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2), "sequence_bias"])
def test_processors_that_read_the_sequence_see_the_plain_loops(tokenizer, processor):
    """Each position is processed with its row's sequence as the plain loop has it at that token: greedy equals the
    plain loop, sampled drafts equal no drafts."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    if processor == "sequence_bias":
        free = _plain(model, prompts, greedy_config(tokenizer, max_new_tokens=40)).completion_ids
        processor = dict(sequence_bias={tuple(free[0, 3:5].tolist()): -50.0, (free[0, 8].item(),): 20.0})
    config = greedy_config(tokenizer, max_new_tokens=40, **processor)
    plain = _plain(model, prompts, config)
    backend = FastBackend(cuda="decoder", speculative=ON)  # the second round drafts the first's completions
    first, second = backend.generate(model, prompts, config), backend.generate(model, prompts, config)
    assert_same_rollout(first, plain)
    assert_same_rollout(second, plain)
    assert second.decode.accepted > 0
    sampled = greedy_config(tokenizer, max_new_tokens=40, do_sample=True, temperature=0.5, **processor)
    spec, none = _rollout(model, prompts, sampled, ON), _rollout(model, prompts, sampled, NO_DRAFTS)
    assert_same_rollout(spec, none)
    valid = _valid(none)
    torch.testing.assert_close(spec.sampler.kept.drawn_logps[valid], none.sampler.kept.drawn_logps[valid],
                               atol=1e-5, rtol=0)


def test_a_round_the_drafts_cannot_serve_decodes_without_them(tokenizer, caplog):
    """The encoder repetition penalty indexes its prompts by batch row: the round runs the plain loop, with the
    reason logged."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=4)
    config = greedy_config(tokenizer, encoder_repetition_penalty=1.3)
    with caplog.at_level(logging.INFO, logger="grpo_trainer.rollout.fast.backend"):
        spec = _rollout(model, prompts, config, ON)
    assert spec.decode is None
    assert "EncoderRepetitionPenaltyLogitsProcessor is not known to read only its own row" in caplog.text
    assert_same_rollout(spec, _plain(model, prompts, config))


def test_models_outside_the_decoder_sample_as_without_drafts(tokenizer):
    """A sliding window shorter than the rollout: the model's own forward serves it, drafts do not."""
    model = model_of_kind("mistral", tokenizer, sliding_window=4)
    prompts = grouped_prompts(tokenizer)
    config = greedy_config(tokenizer)
    spec = _rollout(model, prompts, config, ON)
    assert spec.decode is None
    assert_same_rollout(spec, _plain(model, prompts, config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gpu_bodies_on_cpu(tokenizer, dtype):
    """tests/gpu/test_speculative_cuda.py's bodies, here on CPU (so a break in them fails without a GPU too)."""
    from tests.gpu.bodies import speculative_greedy_equals_plain, speculative_logps_equal_a_forward

    cpu = torch.device("cpu")
    if dtype == torch.float32:
        speculative_greedy_equals_plain(tokenizer, "qwen2.5-0.5b", cpu)
    speculative_logps_equal_a_forward(tokenizer, dtype, cpu)


def test_the_history_survives_a_checkpoint(tokenizer):
    """A backend restored from another's `state_dict` drafts its next round as that one would: the same forwards,
    bit for bit the same values (`RunParts` saves it in every checkpoint)."""
    model = model_of_kind("qwen2", tokenizer)
    prompts = grouped_prompts(tokenizer, repeats=2)
    config = greedy_config(tokenizer, max_new_tokens=40, do_sample=True, temperature=0.5)
    first = FastBackend(cuda="decoder", speculative=ON)
    torch.manual_seed(0)
    first.generate(model, prompts, config)
    restored, fresh = FastBackend(cuda="decoder", speculative=ON), FastBackend(cuda="decoder", speculative=ON)
    restored.load_state_dict(first.state_dict())
    assert restored.speculation[1].tokens == first.speculation[1].tokens > 0
    outs = []
    for backend in (first, restored, fresh):
        torch.manual_seed(0)  # the first round's completions again: the history predicts them
        outs.append(backend.generate(model, prompts, config))
    assert outs[0].decode == outs[1].decode and torch.equal(outs[0].sampler.logps, outs[1].sampler.logps)
    assert outs[2].decode.forwards > 2 * outs[0].decode.forwards  # without the history: many more forwards
    assert torch.equal(outs[2].completion_ids, outs[0].completion_ids)  # and the same tokens
    assert FastBackend().state_dict() is None
