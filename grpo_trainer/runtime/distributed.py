"""Multi-process set-up that accelerate and transformers leave to the trainer.

Decisions:

1. A launch that starts several processes but does not train them together is an error, raised when the
   trainer is built. On a machine without CUDA, `accelerate launch` (or `torchrun`) starts N processes, but
   accelerate only syncs them when told to use the CPU; otherwise each process trains alone on the same data
   and exits 0. DeepSpeed on CPU also needs `ddp_backend="gloo"`, or accelerate counts one process while
   DeepSpeed counts N. The error says which setting fixes the launch.
2. FSDP2 on CPU: accelerate (1.15) never turns a CPU run into FSDP, even when `accelerate launch` was given an
   FSDP config; it quietly runs DDP instead. `enable_fsdp2_on_cpu` switches the state to FSDP with a plugin
   read from the `FSDP_*` variables that `accelerate launch` exports. This writes accelerate's private state
   and may need updating when accelerate changes. FSDP1 cannot run on CPU, so it is refused.
3. `unwrapped_for_generation` hands the rollout the bare model: ZeRO-3 weights gathered (unless told not to), and
   activation checkpointing paused by flipping the layers' own flags and restoring them exactly. transformers'
   `gradient_checkpointing_disable`/`_enable` pair (what TRL's `unwrap_model_for_generation` calls every round)
   registers a new input-grad hook on each enable without removing the last, and re-enables with default
   checkpoint kwargs: after N rounds the embedding runs N hooks per call.
4. `decided_by_main` runs a decision about shared files (which checkpoint to resume from, whether output_dir is
   free) on the main process and hands its outcome, result or exception, to all: every process acts alike.
5. The launch (processes, ZeRO stage and offloads, FSDP, the sequence-parallel group) is one typed object,
   `Launch`, read once from the config and the environment `accelerate launch` sets (`config.settings.launch`,
   before any model loads, as the Trainer itself finds them later) and handed to the memory planner, the round
   source's settings (`trainer.source.SourceSettings`: its refusals read it) and the sequence-parallel part (its
   size, and its refusals' settings).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from torch import nn

from grpo_trainer.modeling.unwrap import is_zero3_partitioned

__all__ = ["Launch", "check_processes", "checkpointing_paused", "decided_by_main", "enable_fsdp2_on_cpu",
           "launched_world_size", "prepare_backend", "unwrapped_for_generation"]

T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """How the run's processes train together (decision 5)."""

    processes: int = 1  # world size
    processes_per_node: int = 1  # processes sharing one machine's memory (`LOCAL_WORLD_SIZE`)
    zero_stage: int = 0  # DeepSpeed ZeRO stage (0: no DeepSpeed)
    deepspeed: bool = False  # a DeepSpeed engine wraps the model (any stage)
    zero_reduce_bucket: int = 500_000_000  # DeepSpeed reduce_bucket_size (elements)
    offload_optimizer: bool = False  # ZeRO offload of optimizer state to CPU memory
    offload_parameters: bool = False  # ZeRO-3 offload of parameters to CPU memory
    fsdp: bool = False
    sequence_parallel: int = 1  # parallelism_config's sp_size: processes sharding each row's positions

    @property
    def sharded_weights(self) -> str | None:
        """'DeepSpeed ZeRO-3' or 'FSDP' where the launch shards the weights, else None."""
        return "DeepSpeed ZeRO-3" if self.zero_stage == 3 else "FSDP" if self.fsdp else None


def launched_world_size() -> int:
    """Processes started by the launcher (`WORLD_SIZE`, set by torchrun / `accelerate launch`); 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_processes(accelerator: Accelerator) -> None:
    """Raise when the launcher started several processes that accelerate will not train together."""
    launched = launched_world_size()
    state = accelerator.state
    if launched <= 1 or (accelerator.num_processes == launched and state.distributed_type != DistributedType.NO):
        return
    if getattr(state, "deepspeed_plugin", None) is not None:
        fix = "DeepSpeed without a GPU needs ddp_backend='gloo' (GRPOConfig(ddp_backend='gloo') or --ddp_backend gloo)"
    else:
        fix = ("without a GPU, set the environment variable ACCELERATE_USE_CPU=true (or GRPOConfig(use_cpu=True)) "
               "so that accelerate syncs the processes over gloo")
    raise RuntimeError(
        f"{launched} processes were launched (WORLD_SIZE={launched}), but accelerate sees "
        f"{accelerator.num_processes} with distributed_type={state.distributed_type.value}, so they would not "
        f"train together (and might still exit 0). Fix: {fix}. See docs/DISTRIBUTED.md.")


def enable_fsdp2_on_cpu(accelerator: Accelerator, fsdp_plugin_args: dict | None) -> None:
    """Turn a CPU run that `accelerate launch` started with an FSDP2 config from DDP into FSDP2.

    Call it right after the trainer creates its accelerator, before any model is prepared. `fsdp_plugin_args`:
    `TrainingArguments.fsdp_plugin_args` (from `fsdp=`/`fsdp_config=`), else the FSDP_* variables `accelerate
    launch` exports are read.
    """
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**(fsdp_plugin_args or {}))
    if plugin.fsdp_version != 2:
        raise RuntimeError("FSDP1 cannot run without a GPU (accelerate refuses a CPU device); set "
                           "fsdp_version: 2 in the accelerate config, or use DDP or DeepSpeed on CPU.")
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # read by `accelerator.distributed_type`


def prepare_backend(accelerator: Accelerator, fsdp_plugin_args: dict | None) -> bool:
    """Refuse silent non-distributed launches; run FSDP2 on CPU when it was asked for. Whether FSDP2 was switched on
    here (the trainer then sets its `is_fsdp_enabled`)."""
    switched = _fsdp_requested() and accelerator.distributed_type == DistributedType.MULTI_CPU
    if switched:
        enable_fsdp2_on_cpu(accelerator, fsdp_plugin_args)
    check_processes(accelerator)
    return switched


@contextlib.contextmanager
def checkpointing_paused(model: nn.Module) -> Iterator[None]:
    """Activation checkpointing off inside the context, restored exactly after: the flags of the layers that had it
    on are flipped and nothing else is touched (no hooks added or removed, the checkpoint function and its kwargs
    kept). Generation needs it off: it builds no graph, and `generate` turns its KV cache off under checkpointing
    in training mode."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


@contextlib.contextmanager
def unwrapped_for_generation(model: nn.Module, accelerator: Accelerator, gather_zero3: bool = True
                             ) -> Iterator[nn.Module]:
    """The model without its DDP / DeepSpeed / FSDP wrapper, with activation checkpointing paused and, under ZeRO-3
    with `gather_zero3`, every parameter gathered for the context's duration (its partition hooks removed meanwhile,
    as the optimizer's hooks must not fire during generation). A collective under ZeRO-3: every process enters."""
    unwrapped = accelerator.unwrap_model(model)
    with checkpointing_paused(unwrapped):
        if not (gather_zero3 and is_zero3_partitioned(unwrapped)):
            yield unwrapped
            return
        import deepspeed
        from trl.models.utils import add_hooks, remove_hooks

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            remove_hooks(model)
            try:
                yield unwrapped
            finally:
                add_hooks(model)


def decided_by_main(accelerator: Accelerator, decide: Callable[[], T]) -> T:
    """`decide()` run on the main process only, its result (or the exception it raised) handed to every process:
    a check of shared files runs once, and all processes raise together instead of the others waiting forever at
    the next collective."""
    outcome: list = [(None, None)]
    if accelerator.is_main_process:
        try:
            outcome = [(decide(), None)]
        except Exception as exc:  # noqa: BLE001 - re-raised on every process below
            outcome = [(None, exc)]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome)
    value, error = outcome[0]
    if error is not None:
        raise error
    return value
