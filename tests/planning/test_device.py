"""The memory one process may use, and its override."""

import pytest

from grpo_trainer.planning import DEVICE_MEMORY_ENV, device_memory, parse_size


@pytest.mark.parametrize(("text", "size"), [("6GiB", 6 * 2**30), ("6 GB", 6 * 10**9), ("512MiB", 512 * 2**20),
                                            ("8e9", 8 * 10**9), ("1048576", 2**20), ("1.5gib", 3 * 2**29)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["six GiB", "6 parsecs", ""])
def test_a_bad_size_names_the_variable(text):
    with pytest.raises(ValueError, match=DEVICE_MEMORY_ENV):
        parse_size(text)


def test_the_override_wins(monkeypatch):
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "3GiB")
    memory = device_memory("cpu", processes_per_node=4)
    assert memory.total_bytes == 3 * 2**30 and DEVICE_MEMORY_ENV in memory.source  # per process, as given


def test_cpu_memory_is_shared_by_the_processes_of_a_machine(monkeypatch):
    monkeypatch.delenv(DEVICE_MEMORY_ENV, raising=False)
    one, two = device_memory("cpu", 1), device_memory("cpu", 2)
    assert one.total_bytes > 0 and "MemAvailable" in one.source or "cgroup" in one.source
    assert two.total_bytes < one.total_bytes and "shared by 2 processes" in two.source
