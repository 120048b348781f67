"""Resident memory of CPU training: glibc's heap held to the live tensors.

glibc serves an allocation under its mmap threshold from its heap, and raises that threshold (up to 32 MiB on
64-bit) to the size of every mapped block that is freed. After the first backward pass, the tensors of a layer at
long sequences (a `[B, N, E]` hidden state: 15 MB at 8 x 520 x 896 float32) come from the heap, and the heap keeps
the holes the backward leaves between them: memory the process holds and never returns. Measured on the 2-layer
Qwen2.5-0.5B proxy (benchmarks/RESULTS.md, "Memory planner"): after the backward, 0.4-0.5 GiB free inside glibc's
arena at 512 completion tokens (LoRA), 0.7-1.0 GiB at 1,024 (growing from the first step to the second), so peak
resident memory was 20% above the live tensors.

A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`, as the `MALLOC_MMAP_THRESHOLD_` environment variable sets it)
stops the adjustment: blocks from `MMAP_THRESHOLD_BYTES` up are mapped and unmapped with their tensor, so resident
memory follows the live tensors and the memory planner's prediction holds. Smaller blocks stay on the heap.

Decisions:

1. Only for CPU training, in a glibc process, once; never over the user's own setting (`MALLOC_MMAP_THRESHOLD_`
   in the environment), and `GRPO_TRAINER_GLIBC_HEAP=keep` leaves glibc as it is.
2. The process-wide setting is logged: it is the library changing how its host process allocates.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

__all__ = ["MMAP_THRESHOLD_BYTES", "OPT_OUT", "hold_heap_to_live_tensors", "would_hold"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 4 * 2**20
OPT_OUT = "GRPO_TRAINER_GLIBC_HEAP"  # "keep": leave glibc's dynamic threshold alone
_M_MMAP_THRESHOLD = -3  # <malloc.h>


def would_hold() -> bool:
    """Whether CPU training in this process holds glibc's heap (decision 1), without changing anything: the
    memory planner's CPU figures assume it."""
    return _glibc() is not None and not _left_alone()


def _left_alone() -> bool:
    return os.environ.get(OPT_OUT, "").lower() == "keep" or "MALLOC_MMAP_THRESHOLD_" in os.environ


def _glibc() -> tuple[str, object] | None:
    """(glibc's version, its mallopt), or None for another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return libc.gnu_get_libc_version().decode(), libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries: no glibc heap to hold
        return None


@functools.cache
def hold_heap_to_live_tensors() -> str | None:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` (module docstring), once per process. Returns what this
    process's heap now does, or None where it was left alone (not glibc, the user's setting, the opt-out, or mallopt
    refused)."""
    glibc = _glibc()
    if glibc is None or _left_alone():
        return None
    version, mallopt = glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return None
    message = (f"glibc {version}: blocks of {MMAP_THRESHOLD_BYTES // 2**20} MiB and more are mapped per tensor "
               f"(mmap threshold fixed), so that resident memory follows the live tensors; {OPT_OUT}=keep leaves "
               "glibc's own threshold")
    logger.info("CPU training: %s.", message)
    return message
