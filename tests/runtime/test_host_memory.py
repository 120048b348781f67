"""runtime.host_memory: with glibc's mmap threshold fixed, the holes a backward pass leaves between large tensors
are returned to the system; with glibc's own (dynamic) threshold they stay resident. Each case in a fresh process:
mallopt is process-wide."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo_trainer.runtime import host_memory

if host_memory._glibc() is None:
    pytest.skip("needs glibc (Linux)", allow_module_level=True)

# 24 blocks of 12 MiB, each followed by a kept 64 KiB block, after a freed 20 MiB mapped block has raised glibc's
# threshold to 20 MiB: under it the 12 MiB blocks come from the heap, and freeing them leaves 24 holes of 12 MiB
# (288 MiB, every page touched) pinned between the kept blocks. With the threshold fixed at 4 MiB they are mapped,
# and unmapped when freed.
_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from grpo_trainer.runtime import host_memory

    def rss_mib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

    held = host_memory.hold_heap_to_live_tensors()
    raise_threshold = torch.ones(20 * 2**20, dtype=torch.uint8)
    del raise_threshold
    before = rss_mib()
    large, kept = [], []
    for _ in range(24):
        large.append(torch.ones(12 * 2**20, dtype=torch.uint8))
        kept.append(torch.ones(64 * 1024, dtype=torch.uint8))
    large.clear()
    print(json.dumps({"held": held, "retained_mib": rss_mib() - before}))
""")


def _run(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items()
                               if k not in (host_memory.OPT_OUT, "MALLOC_MMAP_THRESHOLD_")} | env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fixed_threshold_returns_what_the_heap_would_keep():
    held = _run({})
    kept = _run({host_memory.OPT_OUT: "keep"})
    assert held["held"] is not None and kept["held"] is None
    assert kept["retained_mib"] >= 0.75 * 24 * 12, kept  # the control: glibc's own threshold keeps the holes
    assert held["retained_mib"] <= 24 * 12 * 0.1, held  # ~1.5 MiB of kept blocks, not 288 MiB of holes


def test_a_users_own_setting_is_left_alone():
    assert _run({"MALLOC_MMAP_THRESHOLD_": "1048576"})["held"] is None


def test_the_plan_says_when_the_heap_is_not_held():
    from dataclasses import replace

    from grpo_trainer.planning import plan_memory
    from tests.planning.shapes import SETTINGS, SHAPE

    assert not any("glibc" in note for note in plan_memory(SETTINGS, SHAPE).notes)
    notes = plan_memory(replace(SETTINGS, heap_held=False), SHAPE).notes
    assert any("GRPO_TRAINER_GLIBC_HEAP=keep" in note for note in notes)
