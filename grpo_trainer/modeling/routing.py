"""Rollout routing replay (R3) for Mixture-of-Experts models: the experts the sampler chose, recorded per token per
MoE layer, and replayed in the trainer's forwards.

A MoE layer's router scores every expert (`[N, E]` logits), keeps the top k, and combines their outputs with weights
derived from the scores. The sampler (a KV-cache decode) and the trainer (a full-sequence forward) compute the same
logits in other orders, so near-ties flip; and any drift between the weights or precision that sampled and those that
score (an engine, an asynchronous round, bf16) flips more. A flipped expert changes a token's log-prob by far more
than the rounding that flipped it, which makes importance ratios of MoE models noisy even on-policy (arXiv
2510.11370). Replay makes the trainer route every token to the sampler's experts.

Decisions:

1. Routers are found by structure, not by class name: a module with integer `top_k` and `num_experts` (or
   `num_local_experts`) and a `weight` `[E, H]`, whose forward returns `(logits [N, E], weights [N, k], experts
   [N, k])`, as the top-k routers of transformers 5 do. How the combine weights follow from the logits is the
   family's (`FAMILIES`, by `config.model_type`): softmax over all experts then the top k, renormalised over them
   or not (Qwen2-MoE, Qwen3-MoE, OLMoE: `norm_topk_prob`; Mixtral: always), or the top k logits then a softmax over
   them (gpt-oss). Any other model type is refused by name (`moe_family`); a model of a served family whose router
   does not return what its rule computes from its logits is refused at its first routed forward (`RoutingError`).
2. Capture (`recording`): a forward hook on every router keeps its chosen experts; a pre-hook on the decoder keeps
   each call's `[b, s]` token grid. `assemble` lays a rollout's calls out as `[B, S + T, L, k]`: a prefill over the
   prompts (all `B` rows, or each distinct prompt once, expanded to its rows), then one call per decoded token. A
   rollout whose calls follow another pattern (continuous batching) records nothing (None, with the reason).
3. Stored code: `expert + 1` in the smallest integer dtype that holds `E + 1` (uint8 up to 254 experts, int16 up to
   32766), 0 for "not recorded" (left padding, after EOS, the last completion token, which the sampler never fed
   back). 0 is every padding rule's fill value (`Round` widens, concatenates and trims per-token tensors with 0), so
   a padded position routes freely, and such positions are never read by a scored token.
4. Replay (`replaying`): the router still runs; a forward hook replaces its experts with the recorded ones and its
   combine weights with the family rule applied to its own dense logits at those experts. So the router's weight
   gets the gradient of the replayed weights (a softmax over all `E` logits, read at the recorded experts: never a
   softmax of a gathered top k, whose drifted entries would read exact zeros, ISEEKYAN/Megatron-LM #79), and the
   auxiliary load-balancing loss, computed from the same dense logits, stays defined.
5. Under activation checkpointing the layer's forward runs again in the backward pass, after `replaying` has
   returned; each checkpointed decoder layer's function is therefore wrapped to replay its own routes while it runs,
   whenever it runs (`_gradient_checkpointing_func`, as `modeling.replay` does).
6. A packed forward (`modeling.packing`) reorders tokens: `layout` = (rows, columns) of each packed cell in the
   padded batch, and the routes are gathered there (filler cells read some real token's routes: they are never seen
   by a real token nor scored, so any valid experts do).

7. Hooks act only in the thread that registered them: with asynchronous rounds (`trainer.producer`) a producer
   thread samples with the model the main thread trains, and neither may record or replay the other's forwards.
   (The backward's recompute runs in autograd's threads, but only after the context has closed: decision 5 hooks
   the layer for that call alone.)

Shapes: `B` rows, `S` prompt tokens, `T` completion tokens, `N` = tokens of one forward, `L` MoE layers, `E`
experts, `k` experts per token, `H` hidden size, `R`, `W` packed rows and width.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from grpo_trainer.modeling.swaps import swapped

__all__ = ["FAMILIES", "ReplayStats", "Router", "RoutingError", "assemble", "code_dtype", "find_routers",
           "moe_family", "recording", "replayed", "replaying", "unsupported_reason"]

# weights(logits [N, E], experts [N, k] long) -> combine weights [N, k]
ScoreRule = Callable[[Tensor, Tensor], Tensor]


class RoutingError(RuntimeError):
    """Routing capture or replay cannot serve this model or this call."""


def _softmax_then_top_k(normalise: bool, cast: bool) -> ScoreRule:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE / OLMoE (`cast`: back to the logits' dtype) and Mixtral."""

    def weights(logits: Tensor, experts: Tensor) -> Tensor:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E] dense: every expert's score
        chosen = probs.gather(1, experts)  # [N, k]
        if normalise:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return chosen.to(logits.dtype) if cast else chosen

    return weights


def _top_k_then_softmax(logits: Tensor, experts: Tensor) -> Tensor:
    """gpt-oss: a softmax over the chosen experts' logits."""
    return torch.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)


# config.model_type -> config -> its combine-weight rule (decision 1)
FAMILIES: dict[str, Callable[[Any], ScoreRule]] = {
    "qwen2_moe": lambda config: _softmax_then_top_k(bool(config.norm_topk_prob), cast=True),
    "qwen3_moe": lambda config: _softmax_then_top_k(bool(config.norm_topk_prob), cast=True),
    "olmoe": lambda config: _softmax_then_top_k(bool(config.norm_topk_prob), cast=True),
    "mixtral": lambda config: _softmax_then_top_k(True, cast=False),
    "gpt_oss": lambda config: _top_k_then_softmax,
}


@dataclass(frozen=True)
class Router:
    """One MoE layer's router: its decoder layer's index, the module, its expert count and k."""

    layer: int
    module: nn.Module
    experts: int
    top_k: int


def _expert_count(module: nn.Module) -> int | None:
    for name in ("num_experts", "num_local_experts"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    return None


def _is_router(module: nn.Module) -> bool:
    """Decision 1's structure: integer `top_k` and expert count, and a `[E, H]` weight (its full shape under ZeRO-3,
    which partitions it to `[0]` on every process: `ds_shape`)."""
    experts, weight = _expert_count(module), getattr(module, "weight", None)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())
    return (isinstance(getattr(module, "top_k", None), int) and experts is not None
            and isinstance(weight, Tensor) and len(shape) == 2 and shape[0] == experts)


def _config(lm: nn.Module) -> Any:
    config = lm.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unsupported_reason(lm: nn.Module) -> str | None:
    """Why routing replay cannot serve causal LM `lm` (None: it can): not a Mixture-of-Experts model of a served
    family, or no router found by structure."""
    model_type = getattr(_config(lm), "model_type", None)
    if model_type not in FAMILIES:
        return (f"{type(lm).__name__} (model_type {model_type!r}) is not a Mixture-of-Experts family routing replay "
                f"serves ({', '.join(sorted(FAMILIES))})")
    if not find_routers(lm):
        return f"no top-k router was found in {type(lm).__name__}'s decoder layers"
    return None


def moe_family(lm: nn.Module) -> ScoreRule:
    """The combine-weight rule of causal LM `lm`'s family; refused by name otherwise (decision 1)."""
    reason = unsupported_reason(lm)
    if reason is not None:
        raise RoutingError(f"routing replay: {reason}")
    return FAMILIES[_config(lm).model_type](_config(lm))


def _decoder_layers(lm: nn.Module) -> nn.ModuleList:
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    return decoder.layers


def find_routers(lm: nn.Module) -> list[Router]:
    """Every router of causal LM `lm`, in layer order (dense layers of a partly sparse model have none)."""
    found = []
    for index, layer in enumerate(_decoder_layers(lm)):
        for module in layer.modules():
            if _is_router(module):
                found.append(Router(index, module, _expert_count(module), module.top_k))
    return found


def code_dtype(experts: int) -> torch.dtype:
    """The smallest integer dtype that holds codes 0..E (decision 3)."""
    if experts < 255:
        return torch.uint8
    if experts < 32767:
        return torch.int16
    return torch.int32


def _checked(rule: ScoreRule, logits: Tensor, weights: Tensor, experts: Tensor, family: str) -> None:
    """Decision 1's check: the router's own weights are what the family rule computes at its own experts."""
    ours = rule(logits, experts)
    if ours.dtype != weights.dtype or not torch.allclose(ours, weights, rtol=1e-5, atol=1e-6):
        raise RoutingError(f"routing replay: this {family} router's combine weights are not what the {family} rule "
                           "computes from its logits (a changed transformers implementation?); set "
                           "routing_replay='off'")


# ------------------------------------------------------------------------------------------------------- capture


@dataclass
class _Calls:
    grids: list[tuple[int, int]] = field(default_factory=list)  # [b, s] of each decoder call
    experts: list[list[Tensor]] = field(default_factory=list)  # per call: per MoE layer [b * s, k] long
    checked: bool = False


def _call_grid(args: tuple, kwargs: dict) -> tuple[int, int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
    return int(ids.shape[0]), int(ids.shape[1])


@contextlib.contextmanager
def recording(lm: nn.Module) -> Iterator[_Calls]:
    """Within this context every forward of causal LM `lm` records its routers' chosen experts (decision 2); the
    yielded record goes to `assemble` afterwards."""
    rule, family = moe_family(lm), _config(lm).model_type
    routers = find_routers(lm)
    calls = _Calls()
    position = {id(r.module): i for i, r in enumerate(routers)}

    thread = threading.get_ident()

    def on_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != thread:  # decision 7
            return
        calls.grids.append(_call_grid(args, kwargs))
        calls.experts.append([None] * len(routers))

    def on_route(module: nn.Module, args: tuple, output: tuple) -> None:
        if threading.get_ident() != thread:
            return
        logits, weights, experts = output
        if not calls.checked:
            _checked(rule, logits, weights, experts, family)
            calls.checked = True
        calls.experts[-1][position[id(module)]] = experts

    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    handles = [decoder.register_forward_pre_hook(on_call, with_kwargs=True)]
    handles += [r.module.register_forward_hook(on_route) for r in routers]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def assemble(calls: _Calls, experts: int, prompt_mask: Tensor, completion_mask: Tensor,
             prompt_group: Tensor | None = None) -> tuple[Tensor | None, str | None]:
    """A rollout's recorded routes `[B, S + T, L, k]` (decision 3's codes) from its forwards' `calls` (decision 2),
    or None and the reason. `prompt_mask` `[B, S]`, `completion_mask` `[B, T]`: 0 where nothing is kept;
    `prompt_group` `[B]`: each row's distinct prompt, for a prefill over distinct prompts."""
    B, S = prompt_mask.shape
    T = completion_mask.shape[1]
    if not calls.grids:
        return None, "the rollout ran no forward of the model (an engine samples elsewhere)"
    if any(e is None for step in calls.experts for e in step):
        return None, "a router did not run in every forward"
    (rows, width), *decodes = calls.grids
    expand = prompt_group if rows != B else None
    if width != S or (rows != B and (expand is None or int(expand.max()) + 1 != rows)):
        return None, f"the first forward was over [{rows}, {width}] tokens, not a prefill of the [{B}, {S}] prompts"
    if any(grid != (B, 1) for grid in decodes) or len(decodes) > T:
        return None, "the forwards after the prefill were not one token per row each (continuous batching?)"
    k = calls.experts[0][0].shape[-1]
    routes = torch.zeros(B, S + T, len(calls.experts[0]), k, dtype=code_dtype(experts),
                         device=prompt_mask.device)
    prefill = torch.stack(calls.experts[0], 1).view(rows, S, -1, k)  # [rows, S, L, k]
    routes[:, :S] = (prefill if expand is None else prefill[expand]).to(routes.dtype) + 1
    for t, step in enumerate(calls.experts[1:]):  # decode call t fed completion token t
        routes[:, S + t] = torch.stack(step, 1).to(routes.dtype) + 1
    kept = torch.cat([prompt_mask, completion_mask], 1).bool()  # [B, S + T]
    return routes * kept[:, :, None, None].to(routes.dtype), None


# ------------------------------------------------------------------------------------------------------- replay


@dataclass
class ReplayStats:
    """What replay changed: routed tokens per MoE layer, and those whose own top-k set differed from the replayed."""

    tokens: int = 0
    flipped: int = 0

    @property
    def flipped_fraction(self) -> float:
        return self.flipped / self.tokens if self.tokens else 0.0


def replayed(logits: Tensor, own: Tensor, codes: Tensor, rule: ScoreRule) -> tuple[Tensor, Tensor]:
    """The combine weights `[N, k]` and experts `[N, k]` of a replayed router (decision 4): the recorded experts of
    `codes` `[N, k]` (decision 3; rows of 0 keep the router's `own` choice), weighed by `rule` from the dense
    `logits` `[N, E]`, so that the gradient reaches every logit the weights depend on."""
    codes = codes.to(own.device)
    chosen = torch.where(codes > 0, codes.long() - 1, own)
    return rule(logits, chosen), chosen


def _replay_hook(codes: Tensor, rule: ScoreRule, family: str, stats: ReplayStats | None) -> Callable:
    """A router forward hook returning the recorded experts of `codes` `[N, k]` and the family's weights at them,
    in the thread that registered it (decision 7)."""
    thread, checked = threading.get_ident(), [False]

    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        if threading.get_ident() != thread:
            return None
        logits, weights, own = output
        if codes.shape[0] != logits.shape[0]:
            raise RoutingError(f"routing replay: the router routed {logits.shape[0]} tokens but {codes.shape[0]} "
                               "were recorded for this forward")
        if not checked[0]:  # once per router and forward: the rule is the model's, not the data's
            _checked(rule, logits, weights, own, family)
            checked[0] = True
        combine, chosen = replayed(logits, own, codes, rule)
        if stats is not None:
            recorded = (codes > 0).all(-1).to(own.device)
            differs = (chosen.sort(-1).values != own.sort(-1).values).any(-1) & recorded
            stats.tokens += int(recorded.sum())
            stats.flipped += int(differs.sum())
        return logits, combine, chosen

    return hook


def _recomputable(checkpoint: Callable, hooked: Callable[[], list], open_: list[bool]) -> Callable:
    """A stand-in for a decoder layer's `_gradient_checkpointing_func(function, ...)` whose `function` replays its
    routers' routes whenever it runs: inside the replay context its hooks are on; in the backward's recompute after
    it, `hooked()` puts them on for the call (decision 5)."""

    def run(function: Callable, *args: Any, **kwargs: Any) -> Any:
        def routed(*inner: Any, **inner_kwargs: Any) -> Any:
            # the recompute runs with grad; a producer thread's sampling forward (decision 7) without
            if open_[0] or not torch.is_grad_enabled():
                return function(*inner, **inner_kwargs)
            handles = hooked()
            try:
                return function(*inner, **inner_kwargs)
            finally:
                for handle in handles:
                    handle.remove()

        return checkpoint(routed, *args, **kwargs)

    return run


@contextlib.contextmanager
def replaying(lm: nn.Module, routes: Tensor, layout: tuple[Tensor, Tensor] | None = None,
              stats: ReplayStats | None = None) -> Iterator[None]:
    """Within this context (and in checkpointed layers' recomputation after it, decision 5) causal LM `lm`'s forward
    over the `[B, N]` tokens of `routes` `[B, N, L, k]` routes each token to its recorded experts (decision 4).
    `layout`: the packed forward's (rows, columns) `[R, W]` each into the padded batch (decision 6). `stats`: counts
    what replay changed."""
    rule, family = moe_family(lm), _config(lm).model_type
    routers = find_routers(lm)
    if routes.shape[2] != len(routers):
        raise RoutingError(f"routing replay: {len(routers)} MoE layers, but routes for {routes.shape[2]} were "
                           "recorded (another model sampled them?)")
    grid = routes if layout is None else routes[layout]  # [B, N, L, k] or [R, W, L, k]
    per_layer = {id(r.module): grid[:, :, i].reshape(-1, grid.shape[-1]) for i, r in enumerate(routers)}
    open_ = [True]

    def hooked(modules: list[nn.Module]) -> list:
        return [m.register_forward_hook(_replay_hook(per_layer[id(m)], rule, family, stats)) for m in modules]

    handles = hooked([r.module for r in routers])
    try:
        with contextlib.ExitStack() as stack:
            for index, layer in enumerate(_decoder_layers(lm)):
                modules = [r.module for r in routers if r.layer == index]
                if getattr(layer, "_gradient_checkpointing_func", None) is not None and modules:
                    stack.enter_context(swapped(layer, "_gradient_checkpointing_func", lambda checkpoint, m=modules:
                                                _recomputable(checkpoint, lambda: hooked(m), open_)))
            yield
    finally:
        open_[0] = False
        for handle in handles:
            handle.remove()
