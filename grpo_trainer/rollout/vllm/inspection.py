"""What the trainer asks a vLLM engine about its weights: a worker extension (`WorkerInspection`, loaded into vLLM's
workers through `worker_extension_cls`, in the training process for colocate and in the server for `grpo-train
vllm-serve`) and the digest both sides compute.

Decisions:

1. A push reports the engine parameters it did not reach (`grpo_reload_weights`): vLLM's reload only logs them.
   Every parameter of an unquantised dense model comes from some checkpoint name, so a non-empty list means names
   that mapped onto nothing, or a push that was cut short.
2. The engine's weights are compared in the checkpoint's own names, so the trainer never needs vLLM's layout. The
   routing from checkpoint names to engine parameters is vLLM's own: its `load_weights` is run once on meta
   tensors with every parameter's `weight_loader` replaced by a recorder (`_routes`), which records where each name
   lands and with which shard id (`q`/`k`/`v` of a fused QKV projection, `0`/`1` of a merged gate/up). A fused
   parameter is split back along its output dimension in shard order; a padded one (vocabulary rows) is cut to the
   checkpoint's shape. What vLLM routes elsewhere (Mixture-of-Experts experts, tensor-parallel shards) is reported
   as not compared, never guessed.
3. vLLM's CPU build repacks linear weights for its kernels and leaves an empty parameter behind; such a weight is
   read back through the layer's own kernel (`cpu_linear` applied to an identity matrix gives W^T exactly: every
   output is one weight plus exact zeros). The LM head is always read that way on CPU, since the CPU build keeps a
   packed copy of a tied head apart from the embedding.
4. A digest is three float64 sums, of x, |x| and x times a fixed cosine pattern (the last one changes when values
   move within a tensor). Both sides compute it with `digest`, from the same values in the engine's dtype.

Nothing here imports vLLM at module level: the trainer imports `digest` without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["EXTENSION", "WorkerInspection", "checkpoint_view", "digest", "digests_agree", "encode_metadata"]

EXTENSION = "grpo_trainer.rollout.vllm.inspection.WorkerInspection"  # vLLM's `worker_extension_cls`
DIGEST_RTOL = 1e-7  # float64 sums of identical values differ only by summation order (~1e-12 relative)
_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


def encode_metadata(metadata: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> str:
    """`export.inference_weight_metadata`'s (name, dtype, shape) triples as the JSON the worker methods take."""
    return json.dumps([[name, list(shape), str(dtype).removeprefix("torch.")] for name, dtype, shape in metadata])


def digest(tensor: Tensor) -> list[float]:
    """[sum x, sum |x|, sum x cos(0.7071 i)] of `tensor`'s values in float64 (decision 4)."""
    x = tensor.detach().reshape(-1).to("cpu", torch.float64)
    pattern = torch.cos(torch.arange(x.numel(), dtype=torch.float64) * 0.7071)
    return [float(x.sum()), float(x.abs().sum()), float((x * pattern).sum())]


def digests_agree(ours: list[float], theirs: list[float], rtol: float = DIGEST_RTOL) -> bool:
    """Whether two digests are of the same values, up to float64 summation order."""
    scale = max(abs(ours[1]), abs(theirs[1]), 1e-30)
    return all(abs(a - b) <= rtol * scale for a, b in zip(ours, theirs))


def _shard_index(shard: Any) -> int | None:
    if shard is None:
        return 0
    if isinstance(shard, str):
        return _SHARD_ORDER.get(shard)
    return shard if isinstance(shard, int) else None


def _routes(model: nn.Module, metadata: list[tuple[str, list[int], str]]) -> dict[str, list[tuple[str, Any]]]:
    """Checkpoint name -> [(engine parameter, shard id)] as vLLM's `load_weights` routes it (decision 2)."""
    owners: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), name)
    routes: dict[str, list[tuple[str, Any]]] = {}
    current: list[str | None] = [None]

    def recorder(param: Tensor, *args: Any, **kwargs: Any) -> bool:
        # (param, loaded_weight, shard_id) positionally, or by keyword as FusedMoE's loader is called (expert_id:
        # one call per expert, the success flag it asks for answered True so that vLLM tries no other mapping)
        shard = args[1] if len(args) > 1 else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
        if isinstance(shard, (tuple, list)):  # a routing vLLM spreads over several shards: not comparable
            shard = "multi"
        if "expert_id" in kwargs:
            shard = (kwargs["expert_id"], shard)
        routes.setdefault(current[0], []).append((owners.get(id(param), "?"), shard))
        return True

    saved = []
    for _, param in model.named_parameters(remove_duplicate=False):
        saved.append((param, param.__dict__.get("weight_loader"), "weight_loader" in param.__dict__))
        param.weight_loader = recorder

    def meta_weights() -> Iterator[tuple[str, Tensor]]:
        for name, shape, dtype in metadata:
            current[0] = name
            yield name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    try:
        model.load_weights(meta_weights())
    finally:
        for param, loader, had in saved:
            if had:
                param.weight_loader = loader
            else:
                param.__dict__.pop("weight_loader", None)
    return routes


def _read_through_kernel(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """W `[N, K]` of a CPU-packed linear layer, from its kernel (decision 3)."""
    # a column/row-parallel linear, a replicated one (a MoE router's GateLinear), an LM head
    inputs = (getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
              or module.embedding_dim)
    identity = torch.eye(inputs, dtype=dtype)
    return module.cpu_linear(identity, module.weight, None).T.contiguous()


def _engine_tensor(model: nn.Module, name: str) -> Tensor | None:
    """The value engine parameter `name` computes with (decision 3); None when there is no such parameter."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    module_name, _, attribute = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    param = getattr(module, attribute, None)
    if not isinstance(param, Tensor):
        return None
    if attribute == "weight" and hasattr(module, "cpu_linear") and (
            param.numel() == 0 or isinstance(module, ParallelLMHead)):
        return _read_through_kernel(module, param.dtype)
    return param.detach()


def _split(group: Tensor, sources: list[tuple[str, Any]], shapes: dict[str, list[int]]) -> dict[str, Tensor] | None:
    """The checkpoint tensors a (fused or padded) engine parameter holds, or None when its layout is not the
    concatenation of its sources along dim 0 in shard order (decision 2)."""
    if len(sources) == 1:
        name = sources[0][0]
        shape = shapes[name]
        if group.dim() != len(shape) or any(g < s for g, s in zip(group.shape, shape)):
            return None
        return {name: group[tuple(slice(0, s) for s in shape)]}
    order = [(_shard_index(shard), name) for name, shard in sources]
    if any(index is None for index, _ in order) or len({index for index, _ in order}) != len(order):
        return None
    out, offset = {}, 0
    for _, name in sorted(order):
        shape = shapes[name]
        if group.dim() != len(shape) or list(group.shape[1:]) != shape[1:]:
            return None
        out[name] = group[offset:offset + shape[0]]
        offset += shape[0]
    return out if offset == group.shape[0] else None


def checkpoint_view(model: nn.Module, metadata: list[tuple[str, list[int], str]]
                    ) -> tuple[dict[str, Tensor], list[str], list[str]]:
    """The engine's weights under the checkpoint names of `metadata` ((name, shape, dtype) triples), and the names
    that mapped onto no engine parameter and those that could not be compared (decision 2)."""
    routes = _routes(model, metadata)
    shapes = {name: list(shape) for name, shape, _ in metadata}
    groups: dict[str, list[tuple[str, Any]]] = {}
    unmapped = []
    for name, _, _ in metadata:
        targets = routes.get(name)
        if not targets:
            if _engine_tensor(model, name) is not None:  # e.g. a tied head vLLM skips but keeps a copy of
                groups.setdefault(name, []).append((name, None))
            else:
                unmapped.append(name)
            continue
        for group, shard in targets:
            groups.setdefault(group, []).append((name, shard))
    tensors, uncompared = {}, []
    for group, sources in groups.items():
        value = _engine_tensor(model, group)
        split = None if value is None else _split(value, sources, shapes)
        if split is None:
            uncompared += [name for name, _ in sources]
        else:
            tensors.update(split)
    return tensors, unmapped, sorted(set(uncompared) - set(tensors))


class WorkerInspection:
    """vLLM worker extension (`worker_extension_cls`): methods the trainer calls through `collective_rpc`. Over
    HTTP, arguments arrive as strings (JSON)."""

    def _grpo_model(self) -> nn.Module:
        return self.model_runner.get_model()

    def grpo_inspection_version(self) -> int:
        """Lets a client tell that the extension is loaded."""
        return 1

    def grpo_reload_weights(self, weights_iterator: Iterable[tuple[str, Tensor]] | None = None,
                            weights_path: str | None = None) -> list[str] | None:
        """vLLM's in-place reload, returning the engine parameters it did not reach (decision 1); None when the
        model does not report what it loaded."""
        model = self._grpo_model()
        loaded: list[set[str] | None] = []
        original = model.load_weights

        def recording(weights: Iterable[tuple[str, Tensor]]) -> Any:
            result = original(weights)
            loaded.append(set(result) if result is not None else None)
            return result

        model.load_weights = recording  # an instance attribute: vLLM's reload calls model.load_weights
        try:
            self.model_runner.reload_weights(weights_iterator=weights_iterator, weights_path=weights_path)
        finally:
            del model.load_weights
        if not loaded or loaded[0] is None:
            return None
        expected = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}
        return sorted(expected - loaded[0])

    def grpo_checkpoint_digests(self, metadata: str) -> dict[str, Any]:
        """Digests of the engine's weights under the checkpoint names in `metadata` (a JSON list of [name, shape,
        dtype]), with the names that did not map and those not compared (decision 2)."""
        tensors, unmapped, uncompared = checkpoint_view(self._grpo_model(), json.loads(metadata))
        return {"digests": {name: digest(t) for name, t in tensors.items()}, "unmapped": unmapped,
                "uncompared": uncompared, "dtype": str(self.model_runner.model_config.dtype).removeprefix("torch.")}

    def grpo_save_checkpoint_weights(self, metadata: str, folder: str) -> str:
        """Write the engine's weights under their checkpoint names to `folder`/engine.safetensors; its path."""
        from safetensors.torch import save_file

        tensors, _, _ = checkpoint_view(self._grpo_model(), json.loads(metadata))
        path = os.path.join(folder, "engine.safetensors")
        save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, path)
        return path
