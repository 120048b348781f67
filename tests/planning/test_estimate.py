"""The planner's arithmetic: every item checked against a hand-derived size, and the activation formula against
what autograd really saves in a Qwen2 layer (`saved_tensors_hooks`)."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_trainer.modeling.logprobs import LOGITS_CHUNK_BYTES
from grpo_trainer.planning import INSTANTS, activation_bytes_per_token, model_shape, plan_memory
from grpo_trainer.planning.estimate import CPU_RUNTIME_BYTES
from grpo_trainer.rollout.capture import REPLAY_MAX_BYTES
from tests.planning.shapes import SETTINGS, SHAPE, rollout


def item(plan, name):
    found = [i for i in plan.items if i.name == name]
    assert found, f"no item {name!r} in {[i.name for i in plan.items]}"
    return dict(zip(INSTANTS, found[0].bytes))


def test_persistent_items_are_products_of_parameters_and_dtypes():
    plan = plan_memory(SETTINGS, SHAPE)
    assert item(plan, "weights")["rollout"] == 200_000 * 4  # float32
    assert item(plan, "optimizer state")["rollout"] == 2 * 200_000 * 4  # AdamW: two moments in float32
    assert item(plan, "runtime (process, libraries)")["optimizer step"] == CPU_RUNTIME_BYTES
    assert item(plan, "gradients")["optimizer step"] == 200_000 * 4
    # before any layer's gradient, the head's V x E = 64,000 of them
    assert item(plan, "gradients")["backward start"] == 1000 * 64 * 4
    assert item(plan, "gradients")["rollout"] == 0  # dropped by zero_grad before the next round


def test_rollout_items():
    plan = plan_memory(SETTINGS, SHAPE)
    # fast decoder KV cache: 2 (keys, values) x 2 layers x 4 rows x 2 heads x 16 tokens x 16 dims x 4 B
    assert item(plan, "KV cache")["rollout"] == 2 * 2 * 4 * 2 * 16 * 16 * 4 == 32_768
    # replay: layer outputs [4 rows, 2 layers, 16 tokens, 64] float32 = 32,768 B; softmax [4, 10, 1000] = 160,000 B
    replay = item(plan, "replay tensors")
    assert replay["rollout"] == 32_768 + 160_000
    assert replay["loss forward"] == 32_768 + 160_000
    # the backward: the micro-batch was dropped (layer outputs gone); the softmax lives until the head's backward
    assert replay["backward end"] == 0


def test_replay_beyond_the_budget_keeps_the_layer_outputs_only():
    """At V = 151,936 and 8 rows x 1024 tokens the softmax is 4.98 GB > REPLAY_MAX_BYTES (1 GiB): dropped."""
    big = dataclasses.replace(SHAPE, vocab=151_936)
    settings = dataclasses.replace(SETTINGS, micro_batch=8, completion_length=1024)
    assert 8 * 1024 * 151_936 * 4 > REPLAY_MAX_BYTES
    replay = item(plan_memory(settings, big), "replay tensors")
    assert replay["rollout"] == 8 * 2 * (6 + 1024) * 64 * 4  # [B, L, S + T, E] float32 only


def test_log_prob_chunks_follow_logits_chunk_bytes():
    """chunk_rows(1024, 151,936) = 2**27 // (4 x 151,936) = 220 rows; the backward recomputes one chunk of logits
    (no softmax is kept: off-policy rounds keep no replay)."""
    assert LOGITS_CHUNK_BYTES // (4 * 151_936) == 220
    big = dataclasses.replace(SHAPE, vocab=151_936)
    # two passes over a round with one micro-step per optimizer step: the second pass is off-policy
    off_policy = dataclasses.replace(SETTINGS, micro_batch=8, completion_length=256, num_iterations=2)
    chunks = item(plan_memory(off_policy, big), "log-prob chunks")
    assert chunks["loss forward"] == 2 * 220 * 151_936 * 4  # logits and their log-softmax side by side
    assert chunks["backward start"] == 220 * 151_936 * 4
    # a micro-batch of 4 x 10 = 40 completion tokens projects 40 rows, not 220
    small = item(plan_memory(dataclasses.replace(SETTINGS, num_iterations=2), big),
                 "log-prob chunks")
    assert small["backward start"] == 40 * 151_936 * 4


def test_autocast_weight_copies_by_hand():
    """bf16 autocast over float32 weights (found with the CUDA allocator's history: benchmarks/RESULTS.md). Full
    fine-tuning with checkpointing: autocast's cache holds every trained layer's cast until the forward returns,
    2 layers x 40,000 parameters, and the LM head's V x E = 64,000: (80,000 + 64,000) x 2 B = 288,000 B. LoRA (frozen
    base: no cache): the head's cast only, 128,000 B. Without checkpointing the layers' casts are saved tensors
    (counted in the activations), so the item is the head's. The rollout through `model.generate` holds the same
    as each forward; the fast decoder runs without autocast."""
    mixed = dataclasses.replace(SETTINGS, mixed_precision="bfloat16")
    assert item(plan_memory(mixed, SHAPE), "autocast weight copies")["loss forward"] == (2 * 40_000 + 64_000) * 2
    assert item(plan_memory(mixed, SHAPE), "autocast weight copies")["backward start"] == 0  # freed with `out`
    lora = dataclasses.replace(SHAPE, adapter_parameters=1_000)
    assert item(plan_memory(mixed, lora), "autocast weight copies")["loss forward"] == 64_000 * 2
    no_ckpt = dataclasses.replace(mixed, checkpointing=False)
    assert item(plan_memory(no_ckpt, SHAPE), "autocast weight copies")["loss forward"] == 64_000 * 2
    assert not any(i.name == "autocast weight copies" for i in plan_memory(SETTINGS, SHAPE).items)
    fast = item(plan_memory(mixed, SHAPE), "generation working set")["rollout"]
    generate = item(plan_memory(dataclasses.replace(mixed, rollout=rollout("generate")), SHAPE),
                    "generation working set")
    # generate's working set counts every row (the decoder's prefill only the distinct prompts: 4 rows / G = 2)
    # plus the copies: one layer's prefill of 2 more rows x 6 tokens x 2 B x (3 x 128 + 4 x 64 + 3 x 64)
    assert generate["rollout"] - fast == 2 * 6 * 2 * (3 * 128 + 4 * 64 + 3 * 64) + (2 * 40_000 + 64_000) * 2


def test_on_cuda_the_fast_backend_is_planned_as_generate(tmp_path):
    """The fast backend samples with `model.generate` on CUDA (`FastBackend.uses_generate_on`): no replay tensors
    there, so the plan must not count them."""
    from grpo_trainer import GRPOConfig
    from grpo_trainer.trainer import memory

    args = GRPOConfig(output_dir=str(tmp_path), generation_backend="fast", report_to="none", use_cpu=True)
    assert memory.plan_settings(args, prompt_length=8, device="cuda").rollout == rollout("generate", "cuda")
    assert memory.plan_settings(args, prompt_length=8, device="cpu").rollout == rollout("fast")


def test_activations_with_and_without_checkpointing():
    per_token = activation_bytes_per_token(SETTINGS, SHAPE)
    # float32, full training: 4 B x (6 E + 4 H D + 4 FFN) + 4 B x H = 4 x (384 + 256 + 512) + 16
    assert per_token == 4624
    rows, tokens = 4, 16
    checkpointed = plan_memory(SETTINGS, SHAPE)
    # each layer's input and the embedding / final norm outputs: 4 x 16 x 64 x 4 B x (2 + 2)
    assert item(checkpointed, "activations")["loss forward"] == rows * tokens * 64 * 4 * 4
    full = plan_memory(dataclasses.replace(SETTINGS, checkpointing=False), SHAPE)
    layer = rows * (tokens * per_token + 4 * tokens * tokens)  # + the [N, N] float32 attention mask per row
    assert item(full, "activations")["loss forward"] == 2 * layer + rows * tokens * 64 * 4 * 2


def test_what_the_checkpointed_backward_holds_beside_the_recomputed_layer():
    """Rows of 6 + 250 = 256 tokens, 4 rows: one layer's input is 4 x 256 x 64 x 4 B = 262,144 B. The loss forward
    keeps the 2 layers' inputs and the final norm's input and output: 4 x 262,144. At the last layer's recomputation
    (the backward's start here) the final norm's backward has run: the 2 layers' inputs are left; at the first
    layer's recomputation (its end) only that layer's input. The recomputed layer itself does not count its input
    again: 4,624 - 256 = 4,368 B per token (and each row's [256, 256] float32 mask), and its MLP's backward holds
    an intermediate's gradient beside it (128 x 4 B per token)."""
    plan = plan_memory(dataclasses.replace(SETTINGS, completion_length=250), SHAPE)
    activations, recomputed = item(plan, "activations"), item(plan, "layer recomputation")
    assert activations["loss forward"] == 4 * 262_144
    assert recomputed["backward start"] == recomputed["backward end"] == 4 * (256 * (4_368 + 512) + 4 * 256 * 256)
    assert activations["backward start"] == 2 * 262_144 and activations["backward end"] == 262_144


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_padded_attention_mask_is_counted_only_where_a_padded_sdpa_forward_makes_it(checkpointing):
    """The `[N, N]` float32 mask per row (4 rows x 4 B x 16 x 16 = 4,096 B per layer) is in each layer's saved
    tensors under padded SDPA. A packed forward's masks are the "packed attention mask" item (counted there, not
    twice), and flash-attention (varlen) makes none: both drop it from the layer recomputation (checkpointing) or
    from both layers' saved tensors (without)."""
    mask = 4 * 4 * 16 * 16
    where, layers = ("backward start", 1) if checkpointing else ("loss forward", 2)
    name = "layer recomputation" if checkpointing else "activations"
    padded = dataclasses.replace(SETTINGS, checkpointing=checkpointing)
    base = item(plan_memory(padded, SHAPE), name)[where]
    for other in (padded.with_forward(padding_free=True), dataclasses.replace(padded, varlen_attention=True)):
        assert item(plan_memory(other, SHAPE), name)[where] == base - layers * mask


def test_sharding_divides_what_zero_partitions():
    two = dataclasses.replace(SETTINGS, processes=2, processes_per_node=2)
    ddp, zero2, zero3 = (plan_memory(dataclasses.replace(two, zero_stage=z), SHAPE) for z in (0, 2, 3))
    assert item(ddp, "DDP gradient buckets")["rollout"] == 200_000 * 4
    assert item(zero2, "weights")["rollout"] == 200_000 * 4  # replicated
    assert item(zero2, "optimizer state")["rollout"] == 200_000 * 4  # 2 x 200,000 x 4 / 2
    assert item(zero2, "DeepSpeed float32 master weights")["rollout"] == 200_000 * 4 / 2
    assert item(zero2, "gradients")["optimizer step"] == 200_000 * 4 / 2
    assert item(zero3, "weights")["rollout"] == 200_000 * 4 / 2
    assert item(zero3, "ZeRO-3 gathered weights")["rollout"] == 200_000 * 4  # ds3_gather_for_generation


def test_reference_model_only_without_an_adapter():
    beta = dataclasses.replace(SETTINGS, beta=0.04)
    assert item(plan_memory(beta, SHAPE), "reference model")["rollout"] == 200_000 * 4
    adapter = dataclasses.replace(SHAPE, adapter_parameters=5_000)
    names = [i.name for i in plan_memory(beta, adapter).items]
    assert "reference model" not in names  # the policy with its adapter disabled
    assert item(plan_memory(beta, adapter), "optimizer state")["rollout"] == 2 * 5_000 * 4


@pytest.mark.parametrize(("optim", "momentum", "state"), [
    ("adamw_torch_fused", 0.0, 2 * 200_000 * 4), ("adamw_8bit", 0.0, 2 * 200_000), ("sgd", 0.0, 0),
    ("sgd", 0.9, 200_000 * 4), ("adagrad", 0.0, 200_000 * 4), ("lion_8bit", 0.0, 200_000),
    ("some_future_optimizer", 0.0, 2 * 200_000 * 4)])
def test_optimizer_state_by_optimizer(optim, momentum, state):
    plan = plan_memory(dataclasses.replace(SETTINGS, optimizer=optim, sgd_momentum=momentum), SHAPE)
    found = [i for i in plan.items if i.name == "optimizer state"]
    assert (found[0].bytes[0] if found else 0) == state  # an item of 0 bytes is left out of the table
    assert any("counted as AdamW" in i.note for i in found) == (optim == "some_future_optimizer")


def test_accumulation_holds_gradients_through_later_micro_steps():
    """With 2 accumulation steps the second micro-step's loss forward holds the first one's gradients."""
    plan = plan_memory(dataclasses.replace(SETTINGS, accumulation_steps=2, steps_per_generation=2), SHAPE)
    assert item(plan, "gradients")["loss forward"] == 200_000 * 4


def test_the_peak_is_the_largest_instant():
    plan = plan_memory(SETTINGS, SHAPE)
    totals = dict(zip(INSTANTS, plan.totals()))
    assert plan.peak_bytes == max(totals.values()) == totals[plan.peak_instant]
    assert totals["scoring"] == 0  # beta 0, on-policy: no scoring forward in this run


# ------------------------------------------------------------------- the activation formula against autograd


def _saved_per_token_layer(make, autocast: bool, rows: int = 2, tokens: int = 24) -> float:
    """Bytes autograd saves per token in one decoder layer, measured: (4-layer model - 2-layer model) / 2, less
    each layer's [N, N] attention mask and (under autocast) its low-precision weight copies."""
    saved = []
    for layers in (2, 4):
        config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = make(AutoModelForCausalLM.from_config(config, dtype=torch.float32)).train()
        ids = torch.randint(0, 300, (rows, tokens))
        mask = torch.ones(rows, tokens, dtype=torch.long)
        mask[0, :3] = 0  # left padding: the mask is materialised, as in GRPO's rounds
        storages = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1, output_hidden_states=True, use_cache=False)
        saved.append(sum(size for ptr, size in storages.items() if ptr not in parameters))
        shape = model_shape(config)
    per_layer = (saved[1] - saved[0]) / 2
    compute = 2 if autocast else 4
    per_layer -= rows * compute * tokens * tokens  # the attention mask, in the query's dtype
    if autocast:
        per_layer -= shape.linear_parameters / shape.layers * 2  # autocast's bfloat16 weight copies
    return per_layer / (rows * tokens)


def _lora(targets, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    def wrap(model):
        model.enable_input_require_grads()
        return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=dropout, target_modules=targets,
                                                task_type="CAUSAL_LM"))

    return wrap


@pytest.mark.parametrize(("case", "make", "autocast"), [
    ("full float32", lambda m: m, False),
    ("full, bfloat16 autocast", lambda m: m, True),
    ("LoRA on q/k/v/o", _lora(["q_proj", "k_proj", "v_proj", "o_proj"]), False),
    ("LoRA everywhere, dropout", _lora("all-linear", 0.05), False),
])
def test_activation_formula_matches_what_autograd_saves(case, make, autocast):
    measured = _saved_per_token_layer(make, autocast)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    adapter = None
    if case.startswith("LoRA"):
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if "q/k/v/o" in case else "all-linear"
        adapter = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.05 if "dropout" in case else 0.0,
                             target_modules=targets, task_type="CAUSAL_LM")
    settings = dataclasses.replace(SETTINGS, mixed_precision="bfloat16" if autocast else None)
    predicted = activation_bytes_per_token(settings, model_shape(config, adapter))
    assert predicted == pytest.approx(measured, rel=0.06), case


def test_routes_of_routing_replay_by_hand():
    """A Mixture-of-Experts round carries its routes `[B, S + T, L_moe, k]` (`routing_replay`): with SETTINGS' 4 rows
    x (6 + 10) tokens, 2 MoE layers, top-2 of 8 experts (codes 0..8 in one byte): 4 x 16 x 2 x 2 x 1 = 256 B for the
    whole step; 300 experts need int16 codes: 512 B. None for a dense model, or with replay off."""
    moe = dataclasses.replace(SHAPE, routed_layers=2, routed_top_k=2, experts=8)
    on = dataclasses.replace(SETTINGS, routing_replay=True)
    assert SETTINGS.round_rows * SETTINGS.sequence_length == 4 * 16
    plan = plan_memory(on, moe)
    routes, held = item(plan, "routes (routing replay)"), item(plan, "round tensors")
    assert routes["rollout"] == 4 * 16 * 2 * 2 * 1 == 256
    assert {k for k, v in routes.items() if v} == {k for k, v in held.items() if v}  # alive while the round is
    wide = dataclasses.replace(moe, experts=300)
    assert item(plan_memory(on, wide), "routes (routing replay)")["rollout"] == 4 * 16 * 2 * 2 * 2
    for settings, shape in ((SETTINGS, moe), (on, SHAPE)):
        assert all(i.name != "routes (routing replay)" for i in plan_memory(settings, shape).items)


def test_the_shape_of_a_moe_config_counts_its_routers():
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8, num_hidden_layers=3, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])
    shape = model_shape(config)
    assert (shape.routed_layers, shape.routed_top_k, shape.experts) == (2, 2, 8)  # layer 1 is dense
    dense = model_shape(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1))
    assert (dense.routed_layers, dense.routed_top_k, dense.experts) == (0, 0, 0)
