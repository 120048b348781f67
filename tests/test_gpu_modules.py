"""The tests/gpu modules on a machine without CUDA, where each of their tests is skipped before its fixtures are
set up (the `gpu` marker, tests/conftest.py): each module imports, marks its tests `gpu` (skipped per test, not
per module), and every fixture its tests ask for exists and builds here. Their bodies run on CPU in the normal
suite (tests/gpu/bodies.py names where)."""

import importlib
import inspect
from pathlib import Path

import pytest

GPU_MODULES = sorted((Path(__file__).parent / "gpu").glob("test_*.py"))


def _parametrized(test) -> set[str]:
    names = set()
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize":
            argnames = mark.args[0]
            names |= {n.strip() for n in (argnames.split(",") if isinstance(argnames, str) else argnames)}
    return names


@pytest.mark.parametrize("path", GPU_MODULES, ids=lambda path: path.stem)
def test_a_gpu_module_imports_and_its_fixtures_build_on_cpu(path, request):
    module = importlib.import_module(f"tests.gpu.{path.stem}")
    assert module.pytestmark.name == "gpu"
    tests = [value for name, value in vars(module).items() if name.startswith("test_") and inspect.isfunction(value)]
    assert tests
    for test in tests:
        for name in set(inspect.signature(test).parameters) - _parametrized(test):
            request.getfixturevalue(name)  # a missing fixture raises FixtureLookupError


def test_there_are_gpu_modules():
    assert {path.name for path in GPU_MODULES} >= {"test_cuda_bf16.py", "test_offloading_cuda.py",
                                                    "test_static_decode.py", "test_tied_lookup_cuda.py"}
