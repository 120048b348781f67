"""How much memory one process may use: a GPU's free memory, or its share of the machine's available RAM.

Decisions:

1. A GPU: what `torch.cuda.mem_get_info` reports free, plus what this process has already reserved (a model loaded
   before the check). Other processes' use of the GPU is thereby left out.
2. CPU: `MemAvailable` of /proc/meminfo, or the cgroup's limit less its usage where a cgroup (a container, a Slurm
   job) sets one and it is the smaller, plus this process's own resident memory; shared evenly by the processes of
   this machine (`processes_per_node`).
3. `GRPO_TRAINER_DEVICE_MEMORY` (e.g. `6GiB`, `512MiB`, `8e9`) overrides both, per process: to plan for a device
   other than the one at hand, and for tests that simulate a small one.
"""

from __future__ import annotations

import os
import re

from grpo_trainer.planning.settings import DeviceMemory

__all__ = ["DEVICE_MEMORY_ENV", "device_memory", "parse_size"]

DEVICE_MEMORY_ENV = "GRPO_TRAINER_DEVICE_MEMORY"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (`6GiB`, `6 GB`, `512MiB`, `8e9`)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{DEVICE_MEMORY_ENV}={text!r} is not a size; write e.g. 6GiB, 512MiB or 8e9 (bytes).")
    return int(float(match.group(1)) * _UNITS[unit])


def device_memory(device: str, processes_per_node: int = 1) -> DeviceMemory:
    """The memory this process may use on `device` ("cpu" or "cuda"), per the decisions above."""
    override = os.environ.get(DEVICE_MEMORY_ENV)
    if override:
        return DeviceMemory(device, parse_size(override), f"{DEVICE_MEMORY_ENV}={override}")
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        name = torch.cuda.get_device_name()
        return DeviceMemory(device, free + torch.cuda.memory_reserved(),
                            f"free memory of {name} ({total / 2**30:.1f} GiB in all)")
    available, source = _cpu_available()
    own = _own_rss()
    share = max(1, processes_per_node)
    source += f", shared by {share} processes" if share > 1 else ""
    return DeviceMemory(device, (available + own * share) // share, source)


def _cpu_available() -> tuple[int, str]:
    """Free RAM: MemAvailable, or the cgroup's headroom where that is smaller."""
    available = _meminfo("MemAvailable")
    limit = _cgroup_headroom()
    if limit is not None and limit < available:
        return limit, "the cgroup's memory limit less its usage"
    return available, "MemAvailable (/proc/meminfo)"


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


def _cgroup_headroom() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or limit - usage (v1); None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except OSError:
            continue
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def _own_rss() -> int:
    """This process's resident memory: part of what the plan counts, so part of what it may use."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
