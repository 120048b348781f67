"""DeepSpeed on CPU in a launched rank: skip the JIT build of its shared-memory all-reduce op.

DeepSpeed's CPU accelerator compiles `deepspeed_shm_comm` the first time any process group starts through
`deepspeed.comm` (ZeRO engines, and accelerate's Ulysses sequence parallelism): 100-130 s on the 2-core CI machine,
once per environment and per stage, and a killed build leaves a lock that hangs every later launch. Gloo does the same
all-reduces for a tiny model, so every rank script calls this before DeepSpeed starts a group."""

import importlib.util


def skip_shm_op_build() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
