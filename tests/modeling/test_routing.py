"""Rollout routing replay (`modeling.routing`) on tiny random MoE models of every served family, built from configs:
routers found by structure, capture through `generate` and the forward tier, replay equal to the recorded routing
(after a perturbation that flips routes without it), under checkpointing and packing, and the router's gradient by
hand."""

import dataclasses

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from grpo_trainer.modeling import routing
from grpo_trainer.modeling.logprobs import completion_logprobs
from grpo_trainer.modeling.packing import PackedBatch, PackingSettings
from grpo_trainer.rollout.fast.forward import forward_rollout
from grpo_trainer.rollout.fast.guard import resolved
from grpo_trainer.rollout.generate import generate_rollout
from tests.helpers import greedy_config, grouped_prompts


def _common(tokenizer):
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


FAMILY_CONFIGS = {
    "qwen2_moe": lambda c: Qwen2MoeConfig(**c, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": lambda c: Qwen3MoeConfig(**c, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                                          head_dim=8, norm_topk_prob=True),
    "mixtral": lambda c: MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": lambda c: OlmoeConfig(**c, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda c: GptOssConfig(**c, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                      layer_types=["full_attention"] * 2),
}


def moe_of_family(tokenizer, family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILY_CONFIGS[family](_common(tokenizer)), dtype=torch.float32).eval()


def sampled_with_routes(model, tokenizer, backend: str = "forward", **config):
    """A rollout of `model` on grouped prompts (the forward tier, or `generate`) and its recorded routes."""
    prompts = grouped_prompts(tokenizer)
    settings = greedy_config(tokenizer, **config)
    with torch.no_grad(), routing.recording(model) as calls:
        out = forward_rollout(model, prompts, resolved(model, settings)) if backend == "forward" \
            else generate_rollout(model, prompts, settings)
    group = prompts.distinct_rows()[1]
    routes, reason = routing.assemble(calls, routing.find_routers(model)[0].experts, out.prompt_mask,
                                      out.completion_mask, group)
    assert reason is None, reason
    return out, routes


def routed(model, input_ids, attention_mask, routes=None, layout=None):
    """The trainer's routing `[B, N, L, k]` in a forward (codes as recorded), with replay when `routes` is given."""
    replay = routing.replaying(model, routes, layout) if routes is not None else torch.no_grad()
    with torch.no_grad(), replay, routing.recording(model) as calls:
        model(input_ids=input_ids, attention_mask=attention_mask)
    B, N = input_ids.shape
    return torch.stack(calls.experts[0], 1).view(B, N, len(calls.experts[0]), -1) + 1


def perturb_routers(model, scale: float = 0.5) -> None:
    torch.manual_seed(5)
    with torch.no_grad():
        for router in routing.find_routers(model):
            router.module.weight.add_(scale * torch.randn_like(router.module.weight))


def as_sets(codes):
    return codes.sort(-1).values


# --------------------------------------------------------------------------------------------- finding routers


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_routers_are_found_by_structure_in_every_served_family(tokenizer, family):
    model = moe_of_family(tokenizer, family)
    routers = routing.find_routers(model)
    assert [r.layer for r in routers] == [0, 1]
    assert all(r.top_k == 2 and r.experts == r.module.weight.shape[0] for r in routers)
    assert routing.unsupported_reason(model) is None


def test_a_dense_model_and_an_unknown_family_are_refused_by_name(tokenizer, tiny_model):
    with pytest.raises(routing.RoutingError, match="model_type 'qwen2'.* not a Mixture-of-Experts family"):
        routing.moe_family(tiny_model)
    llama = AutoModelForCausalLM.from_config(LlamaConfig(**_common(tokenizer)))
    assert "model_type 'llama'" in routing.unsupported_reason(llama)


def test_code_dtype_is_the_smallest_that_holds_every_expert_plus_the_free_code():
    assert routing.code_dtype(8) == torch.uint8 and routing.code_dtype(254) == torch.uint8
    assert routing.code_dtype(255) == torch.int16 and routing.code_dtype(128 * 200) == torch.int16


# ----------------------------------------------------------------------------------------------------- capture


@pytest.mark.parametrize("backend", ["forward", "generate"])
def test_capture_records_the_samplers_experts_per_token_and_layer(tokenizer, backend):
    """The recorded routes are the routing of a full forward over the rollout's tokens at the same weights (float32:
    no near-tie flips on this model), with 0 where nothing was fed or the mask is 0."""
    model = moe_of_family(tokenizer, "qwen3_moe")
    out, routes = sampled_with_routes(model, tokenizer, backend)
    B, S = out.prompt_ids.shape
    T = out.completion_ids.shape[1]
    assert routes.shape == (B, S + T, 2, 2) and routes.dtype == torch.uint8
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1).bool()
    mask[:, -1] = False  # the last completion token is never fed back: not recorded
    assert bool((routes[mask] > 0).all()) and bool((routes[~mask] == 0).all())
    own = routed(model, torch.cat([out.prompt_ids, out.completion_ids], 1), torch.cat(
        [out.prompt_mask, out.completion_mask], 1))
    assert torch.equal(as_sets(own)[mask], as_sets(routes.long())[mask])


def test_capture_refuses_calls_that_are_not_prefill_then_one_token_per_row(tokenizer):
    model = moe_of_family(tokenizer, "mixtral")
    ids = torch.randint(0, 20, (2, 5))
    with torch.no_grad(), routing.recording(model) as calls:
        model(ids)
        model(ids[:, :2])  # two tokens at a time
    routes, reason = routing.assemble(calls, 4, torch.ones(2, 5), torch.ones(2, 3))
    assert routes is None and "not one token per row" in reason


# ------------------------------------------------------------------------------------------------------ replay


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_replay_routes_as_the_sampler_did_and_scores_its_log_probs(tokenizer, family):
    """(a) In-process float32, the forward tier samples and records. The trainer's forward with replay routes every
    token as recorded, and its log-probs equal the sampler's (up to the KV-cache decode's summation order). Then the
    routers are perturbed: without replay routes flip; with replay the trainer still routes exactly as recorded."""
    model = moe_of_family(tokenizer, family)
    out, routes = sampled_with_routes(model, tokenizer, do_sample=True, temperature=1.0)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    kept = routes[..., 0] > 0  # [B, S + T, L]
    T = out.completion_ids.shape[1]
    assert torch.equal(as_sets(routed(model, ids, mask, routes))[kept], as_sets(routes.long())[kept])
    with torch.no_grad(), routing.replaying(model, routes):
        logps = completion_logprobs(model, ids, mask, T).logps
    scored = out.completion_mask.bool()
    assert (logps - out.sampler.logps)[scored].abs().max() < 1e-5

    perturb_routers(model)
    without = routed(model, ids, mask)
    assert not torch.equal(as_sets(without)[kept], as_sets(routes.long())[kept])  # the perturbation flips routes
    assert torch.equal(as_sets(routed(model, ids, mask, routes))[kept], as_sets(routes.long())[kept])


def test_replay_counts_the_routes_it_changed(tokenizer):
    model = moe_of_family(tokenizer, "olmoe")
    out, routes = sampled_with_routes(model, tokenizer)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    stats = routing.ReplayStats()
    with torch.no_grad(), routing.replaying(model, routes, stats=stats):
        model(input_ids=ids, attention_mask=mask)
    assert stats.tokens == int((routes[..., 0] > 0).sum()) and stats.flipped == 0
    perturb_routers(model)
    stats = routing.ReplayStats()
    with torch.no_grad(), routing.replaying(model, routes, stats=stats):
        model(input_ids=ids, attention_mask=mask)
    assert 0 < stats.flipped < stats.tokens


def test_replay_gathers_the_routes_into_a_packed_layout(tokenizer):
    """A packed forward's tokens are in another order: replay reads each packed cell's routes at its padded
    (row, column); the packed routing then equals the recorded one on every real token."""
    model = moe_of_family(tokenizer, "qwen3_moe")
    out, routes = sampled_with_routes(model, tokenizer)
    perturb_routers(model)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    packed = PackedBatch.of(ids, mask, out.completion_ids.shape[1], PackingSettings(token_budget=64))
    with torch.no_grad(), routing.replaying(model, routes, packed.sources), routing.recording(model) as calls:
        model(input_ids=packed.input_ids, position_ids=packed.position_ids)
    R, W = packed.input_ids.shape
    got = torch.stack(calls.experts[0], 1).view(R, W, 2, 2) + 1
    expected = routes[packed.sources].long()  # [R, W, L, k]
    real = expected[..., 0, 0] > 0
    assert real.sum() > 0 and torch.equal(as_sets(got)[real], as_sets(expected)[real])


def test_replay_survives_gradient_checkpointings_recompute(tokenizer):
    """Under checkpointing the layers run again in the backward, after the replay context: they must replay there
    too, else the recomputed graph is another routing's (wrong gradients; or checkpointing's metadata check fails).
    The gradients equal those of the same replayed forward without checkpointing."""
    model = moe_of_family(tokenizer, "mixtral")
    out, routes = sampled_with_routes(model, tokenizer)
    perturb_routers(model)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    T = out.completion_ids.shape[1]

    def gradients(checkpointing: bool):
        model.zero_grad()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        with routing.replaying(model, routes):
            logps = completion_logprobs(model, ids, mask, T).logps
        (logps * out.completion_mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)
    assert any("gate" in n and plain[n].abs().sum() > 0 for n in plain)


def test_replay_refuses_routes_of_another_shape(tokenizer):
    model = moe_of_family(tokenizer, "qwen3_moe")
    ids = torch.randint(0, 20, (2, 5))
    with pytest.raises(routing.RoutingError, match="2 MoE layers, but routes for 3"):
        with routing.replaying(model, torch.ones(2, 5, 3, 2, dtype=torch.uint8)):
            pass
    with pytest.raises(routing.RoutingError, match="routed 10 tokens but 8 were recorded"):
        with torch.no_grad(), routing.replaying(model, torch.ones(2, 4, 2, 2, dtype=torch.uint8)):
            model(ids)


# ---------------------------------------------------------------------------------------------- router gradient


def _router(cls, config, weight):
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


def test_router_gradient_of_a_replayed_softmax_router_by_hand():
    """(c) A Qwen3-MoE router without renormalisation, E = 3, k = 2, H = 2, one token h = [1, 0], logits
    l = [0, ln 2, ln 3], so p = softmax(l) = [1, 2, 3] / 6. The router itself picks {2, 1}; the sampler recorded
    {0, 1} (a drifted choice: expert 0 is outside the router's own top-k). Replayed weights w = (p0, p1) =
    (1/6, 2/6), read from the DENSE softmax (a softmax of the router's own top-k would read exact zero for expert 0).
    Loss L = w0 + w1 = 1/2. dL/dl_m = p_m (1[m in R] - (p0 + p1)): (1/6)(1/2) = 1/12, (2/6)(1/2) = 1/6,
    (3/6)(0 - 1/2) = -1/4. dL/dW = dL/dl outer h: first column [1/12, 1/6, -1/4], second column 0."""
    config = Qwen3MoeConfig(hidden_size=2, num_experts=3, num_experts_per_tok=2, norm_topk_prob=False)
    log = torch.log(torch.tensor([1.0, 2.0, 3.0]))
    router = _router(Qwen3MoeTopKRouter, config, torch.stack([log, torch.zeros(3)], 1))
    logits, _, own = router(torch.tensor([[1.0, 0.0]]))
    assert sorted(own[0].tolist()) == [1, 2]
    rule = routing.FAMILIES["qwen3_moe"](config)
    weights, chosen = routing.replayed(logits, own, torch.tensor([[1, 2]], dtype=torch.uint8), rule)  # codes 1, 2
    assert chosen.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[1 / 6, 2 / 6]]))
    weights.sum().backward()
    torch.testing.assert_close(router.weight.grad, torch.tensor([[1 / 12, 0.0], [1 / 6, 0.0], [-1 / 4, 0.0]]))


def test_router_gradient_of_a_replayed_renormalised_router_by_hand():
    """(c) Mixtral (always renormalised over the chosen experts), the same router and recorded {0, 1}:
    w_i = e^{l_i} / (e^{l_0} + e^{l_1}) = (1/3, 2/3). L = w0 = 1/3. dL/dl_0 = w0 (1 - w0) = 2/9,
    dL/dl_1 = -w0 w1 = -2/9, dL/dl_2 = 0 (outside the recorded set, renormalisation cancels it)."""
    config = MixtralConfig(hidden_size=2, num_local_experts=3, num_experts_per_tok=2)
    log = torch.log(torch.tensor([1.0, 2.0, 3.0]))
    router = _router(MixtralTopKRouter, config, torch.stack([log, torch.zeros(3)], 1))
    logits, _, own = router(torch.tensor([[1.0, 0.0]]))
    weights, _ = routing.replayed(logits, own, torch.tensor([[1, 2]], dtype=torch.uint8),
                                  routing.FAMILIES["mixtral"](config))
    torch.testing.assert_close(weights, torch.tensor([[1 / 3, 2 / 3]]))
    weights[0, 0].backward()
    torch.testing.assert_close(router.weight.grad, torch.tensor([[2 / 9, 0.0], [-2 / 9, 0.0], [0.0, 0.0]]))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_the_router_gets_a_gradient_through_a_replayed_model(tokenizer, family):
    """Every router weight of the model gets a non-zero gradient from a replayed forward's log-probs alone, and the
    auxiliary load-balancing loss (from the dense logits) stays finite."""
    model = moe_of_family(tokenizer, family)
    out, routes = sampled_with_routes(model, tokenizer)
    perturb_routers(model)
    model.train()
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with routing.replaying(model, routes):
        result = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    logps = torch.log_softmax(result.logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.isfinite(result.aux_loss)
    (logps * mask[:, 1:]).sum().backward()
    for router in routing.find_routers(model):
        assert router.module.weight.grad.abs().sum() > 0


def test_a_router_whose_weights_differ_from_its_familys_rule_is_refused(tokenizer):
    model = moe_of_family(tokenizer, "qwen3_moe")
    model.config.norm_topk_prob = False  # the routers were built renormalising: the rule no longer describes them
    with pytest.raises(routing.RoutingError, match="not what the qwen3_moe rule computes"):
        with torch.no_grad(), routing.recording(model):
            model(torch.randint(0, 20, (1, 4)))


def test_replayed_weights_are_bitwise_the_routers_own_at_its_own_choice(tokenizer):
    """With the routes the model itself takes, replay changes nothing: equal logits, bitwise."""
    model = moe_of_family(tokenizer, "qwen2_moe")
    ids = torch.randint(0, 20, (2, 6))
    own = routed(model, ids, torch.ones_like(ids)).to(torch.uint8)
    with torch.no_grad():
        plain = model(ids).logits
        with routing.replaying(model, own):
            again = model(ids).logits
    assert torch.equal(plain, again)


def test_families_rules_cover_the_documented_model_types():
    assert sorted(routing.FAMILIES) == ["gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
    assert dataclasses.is_dataclass(routing.ReplayStats)


def test_capture_refuses_a_first_forward_that_is_not_the_prompts_prefill(tokenizer):
    model = moe_of_family(tokenizer, "olmoe")
    with torch.no_grad(), routing.recording(model) as calls:
        model(torch.randint(0, 20, (3, 5)))  # 3 rows for 4 prompts, no grouping given
    routes, reason = routing.assemble(calls, 8, torch.ones(4, 5), torch.ones(4, 2))
    assert routes is None and "not a prefill of the [4, 5] prompts" in reason
    routes, reason = routing.assemble(calls, 8, torch.ones(3, 6), torch.ones(3, 2))
    assert routes is None and "[3, 5] tokens" in reason
