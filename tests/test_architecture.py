"""The import rules of ARCHITECTURE.md: each sub-package imports only the sub-packages below it.

Read from the source with `ast`, so a rule broken anywhere (a function-level import included) fails here with the
file, the line and the rule.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"

# sub-package -> the sub-packages it may import (besides itself). Keep in step with ARCHITECTURE.md.
ALLOWED: dict[str, set[str]] = {
    "algorithms": set(),
    "data": set(),
    "modeling": {"algorithms"},
    "config": {"algorithms", "data", "modeling", "rewards", "rollout", "runtime"},
    "rewards": {"algorithms", "data"},
    "runtime": {"algorithms", "modeling"},
    "reporting": {"algorithms"},
    "rollout": {"algorithms", "data", "modeling", "runtime"},
    "trainer": {"algorithms", "config", "data", "modeling", "reporting", "rewards", "rollout", "runtime"},
    "cli": {"algorithms", "config", "data", "modeling", "reporting", "rewards", "rollout", "runtime", "trainer"},
    "experimental": {"config", "trainer"},
}
# Top-level modules: the public API (`__init__`) and the seeds' public path for estimators (`advantage`).
TOP_LEVEL = {"__init__.py": None, "advantage.py": {"algorithms"}}


def _imported_subpackages(path: Path) -> list[tuple[int, str]]:
    """(line, sub-package) for every import of `grpo_trainer.<sub-package>` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "grpo_trainer":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1]))
            else:  # `from grpo_trainer import x`: x is a sub-package, or a public name of the top level
                found += [(node.lineno, alias.name) if (PACKAGE / alias.name).is_dir() else (node.lineno, "<top>")
                          for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[1]) for alias in node.names
                      if alias.name.startswith("grpo_trainer.")]
    return found


def test_every_module_lives_in_a_known_subpackage():
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1:
            assert relative.name in TOP_LEVEL, f"{relative}: new top-level module; put it in a sub-package"
        else:
            assert relative.parts[0] in ALLOWED, f"{relative}: sub-package {relative.parts[0]!r} has no import rule"


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_subpackages_import_only_what_their_rule_allows(subpackage):
    broken = []
    for path in sorted((PACKAGE / subpackage).rglob("*.py")):
        for line, imported in _imported_subpackages(path):
            if imported != subpackage and imported not in ALLOWED[subpackage]:
                broken.append(f"{path.relative_to(PACKAGE)}:{line} imports {imported!r}")
    assert not broken, f"{subpackage}/ may import only {sorted(ALLOWED[subpackage])}:\n" + "\n".join(broken)


def test_the_rules_form_layers_without_cycles():
    """A rule that let two sub-packages import each other would make their order meaningless."""
    for package, allowed in ALLOWED.items():
        for other in allowed:
            assert package not in ALLOWED[other], f"{package} and {other} may import each other"


def test_the_advantage_alias_exports_the_estimators():
    import grpo_trainer.advantage as public
    from grpo_trainer.algorithms import advantage

    assert public.GRPOAdvantage is advantage.GRPOAdvantage and set(public.__all__) == set(advantage.__all__)
    for _, imported in _imported_subpackages(PACKAGE / "advantage.py"):
        assert imported in TOP_LEVEL["advantage.py"]


def _module_graph() -> dict[str, set[str]]:
    """module -> the grpo_trainer modules it imports anywhere in its source (function level and `TYPE_CHECKING`
    blocks included; `from package import module` counts as importing that module)."""
    def name_of(path: Path) -> str:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("grpo_trainer"):
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("grpo_trainer")}
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def test_no_module_imports_itself_through_others():
    """No import cycle between modules, not even one hidden behind `TYPE_CHECKING` or inside a function."""
    graph, cycles = _module_graph(), []
    state: dict[str, str] = {}  # "visiting" or "done"

    def visit(module: str, path: list[str]) -> None:
        state[module] = "visiting"
        for imported in sorted(graph[module]):
            if state.get(imported) == "visiting":
                cycles.append(" -> ".join(path[path.index(imported):] + [module, imported]) if imported in path
                              else f"{module} -> {imported}")
            elif imported not in state:
                visit(imported, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
