"""Full parameter values and their digest, to compare processes and runs in the multi-process tests (test-only: the
library never needs a gathered copy of every parameter)."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn

from grpo_trainer.modeling.unwrap import is_zero3_partitioned


def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Full copies (on CPU) of the parameters of an unwrapped model, on every process. A collective."""
    params = dict(model.named_parameters())
    if is_zero3_partitioned(model):  # each process holds a partition
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().cpu().clone() for name, p in params.items()}
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in params.items()}


def parameter_digest(params: dict[str, Tensor]) -> str:
    """A short hash of parameter values, to compare processes cheaply."""
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(params[name].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
