"""The importance-sampling correction on multi-turn rollouts sampled by real vLLM with tools: vLLM's log-probs are
kept turn after turn, the tool's tokens are masked out of the correction, and the weight still enters the loss."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_trainer import GRPOTrainer
from grpo_trainer.cli.toy import make_tokenizer
from grpo_trainer.modeling.logprobs import completion_logprobs
from tests.tool_helpers import get
from tests.vllm_integration.vllm_helpers import trainer_args

TOKENIZER = make_tokenizer(tool_calling=True)
CALL = ["<|assistant|>", "<call>", "g", "e", "t", "</call>", "<|end|>"]  # each token's successor in a call
RESULT = TOKENIZER("<|tool|>42<|end|><|assistant|>", add_special_tokens=False)["input_ids"]


def calling_model():
    """A tiny Qwen2 (head size 32, runnable by vLLM's CPU build) that writes `<call>get</call><|end|>` after every
    assistant header with probability ~0.6: a bigram model. Attention and MLP outputs are zero, so the last hidden
    state is the current token's (one-hot) embedding; the untied head gives each token of the call a logit of 6.3 to
    8.4 for its successor (a different log-prob at every position, so tokens scored out of place cannot agree)."""
    vocab = len(TOKENIZER)
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=TOKENIZER.pad_token_id, bos_token_id=None,
                         eos_token_id=[TOKENIZER.eos_token_id, TOKENIZER.convert_tokens_to_ids("<|end|>")])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = TOKENIZER.convert_tokens_to_ids(CALL)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, 128))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.randn(vocab, 128) * 0.01
        for step, (token, successor) in enumerate(zip(ids, ids[1:])):
            head[successor, token] = 0.55 + 0.03 * step  # x sqrt(128) after the final RMSNorm: logit 6.2 to 7.9
        model.lm_head.weight.copy_(head)
    model.generation_config.pad_token_id = TOKENIZER.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def _trainer(tmp_path, **overrides):
    prompts = [[{"role": "user", "content": f"secret {i}?"}] for i in range(8)]
    args = trainer_args(tmp_path, **{"max_completion_length": 32, "max_steps": 1, "max_tool_calling_iterations": 1,
                                     "vllm_importance_sampling_mode": "token_truncate", **overrides})
    return GRPOTrainer(calling_model(), lambda completions, **kw: [float(i % 2) for i in range(len(completions))],
                       args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=TOKENIZER,
                       tools=[get])


def test_vllms_logprobs_follow_the_tokens_of_every_turn_and_tool_tokens_are_masked(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] > 0  # some rollouts called the tool and went on after its result
    # the correction ran on the multi-turn round: every sampled token of every turn, float32 on both sides
    assert logged["sampling/sampling_logp_difference/max"] < 1e-4
    assert 0.9999 < logged["sampling/importance_sampling_ratio/min"] <= logged[
        "sampling/importance_sampling_ratio/max"] < 1.0001
    (round_,) = trainer.buffer.parts
    tool_rows = (round_.env_mask == 0).any(1) & round_.completion_mask.bool().any(1)
    assert tool_rows.any()
    result_at = [row.tolist().index(0) for row in round_.env_mask[tool_rows]]  # the tool result's first token
    assert all(round_.completion_ids[tool_rows][i, s:s + len(RESULT)].tolist() == RESULT
               for i, s in enumerate(result_at))
    # the engine's values sit on their own tokens, in every turn: they are the sampling policy's log-probs there
    # (the policy as it was before the step: the same seeded model)
    ids = torch.cat([round_.prompt_ids, round_.completion_ids], 1)
    mask = torch.cat([round_.prompt_mask, round_.completion_mask], 1)
    with torch.no_grad():
        ours = completion_logprobs(calling_model(), ids, mask, round_.completion_ids.shape[1]).logps
    sampled = round_.loss_mask.bool()
    assert (round_.sampler.logps - ours)[sampled].abs().max() < 1e-4
    after_result = torch.arange(sampled.shape[1]) > min(result_at)
    assert (sampled & after_result)[tool_rows].any()  # second-turn tokens were compared too
    # tool tokens: no engine value (0), never compared (their weight is 1)
    tool = round_.completion_mask.bool() & (round_.env_mask == 0)
    assert round_.sampler.logps[tool].eq(0).all() and round_.token_weights[tool].eq(1).all()
    assert (ours[tool] < -0.01).any()  # a real log-prob there would have differed from 0


def test_the_weight_enters_the_loss_of_a_multi_turn_round(tmp_path):
    # a band [2, 3] that excludes every weight (~1): every sampled token's weight is 0, so with beta = 0 the loss is
    # 0 and the parameters stay where they were
    trainer = _trainer(tmp_path, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=2.0,
                       vllm_importance_sampling_clip_max=3.0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] > 0
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
