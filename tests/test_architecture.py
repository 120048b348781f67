"""The import rules of ARCHITECTURE.md: each sub-package imports only the sub-packages below it.

Read from the source with `ast`, so a rule broken anywhere (a function-level import included) fails here with the
file, the line and the rule.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_trainer"

# sub-package -> the sub-packages it may import (besides itself). Keep in step with ARCHITECTURE.md.
ALLOWED: dict[str, set[str]] = {
    "algorithms": set(),
    "data": set(),
    "diagnosis": set(),
    "modeling": {"algorithms"},
    "config": {"algorithms", "data", "diagnosis", "modeling", "planning", "rewards", "rollout", "runtime"},
    "rewards": {"algorithms", "data"},
    "runtime": {"algorithms", "modeling"},
    "reporting": {"algorithms"},
    "rollout": {"algorithms", "data", "modeling", "runtime"},
    "planning": {"algorithms", "modeling", "rollout"},
    "trainer": {"algorithms", "config", "data", "diagnosis", "modeling", "planning", "reporting", "rewards", "rollout",
                "runtime"},
    "cli": {"algorithms", "config", "data", "diagnosis", "modeling", "planning", "reporting", "rewards", "rollout",
            "runtime", "trainer"},
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


def test_test_modules_have_unique_names():
    """Test folders are not packages, so pytest imports each test module by its file name: a second
    `test_x.py` anywhere under tests/ fails the whole suite's collection ("import file mismatch")."""
    names = [path.name for path in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


# ------------------------------------------------------------------------ ARCHITECTURE.md names what exists

ROOT = PACKAGE.parent
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?$")
_PATH = re.compile(r"^[\w./-]*\.(py|md|yaml|json|sh)$|^[\w./-]+/$")


def _code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text (fenced blocks left out)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _repository_files() -> list[str]:
    """Every file and folder of the repository (tracked or new), as paths relative to its root, folders with '/'."""
    found = []
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if relative.parts[0].startswith(".") or "__pycache__" in relative.parts or "egg-info" in str(relative):
            continue
        found.append(relative.as_posix() + ("/" if path.is_dir() else ""))
    return found


def _class_attributes(node: ast.ClassDef) -> set[str]:
    """A class's methods, annotated and class-level fields, and `self.x` attributes."""
    attributes = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            attributes.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                and isinstance(item.value, ast.Name) and item.value.id == "self":
            attributes.add(item.attr)
        elif isinstance(item, ast.Assign) and item in node.body:
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return attributes


def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the names it defines, not imports; class -> its methods and attributes), read with `ast`. Modules
    are keyed by their dotted path below `grpo_trainer` (a package by its own name)."""
    modules, classes = {}, {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        dotted = ".".join(part for part in path.relative_to(PACKAGE).with_suffix("").parts if part != "__init__")
        names = modules.setdefault(dotted, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                             if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(_class_attributes(node))
    return modules, classes


def _names_outside_the_package() -> set[str]:
    """Names the document may use that the package does not define: GRPOConfig's fields (TrainingArguments' too),
    the tests' shared helpers, what a test module the document cites defines at its top level (a table a recipe
    says to extend), and the environment variables the package reads."""
    import dataclasses

    from grpo_trainer import GRPOConfig

    cited = {ROOT / span for span in _code_spans(ARCHITECTURE.read_text())
             if span.startswith("tests/") and span.endswith(".py") and (ROOT / span).is_file()}
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    for path in {ROOT / "tests" / "helpers.py"} | cited:
        tree = ast.parse(path.read_text())
        names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    return names | set(re.findall(r"\b(GRPO_TRAINER_[A-Z_]+)\b", source))


def _resolves(span: str, modules: dict[str, set[str]], classes: dict[str, set[str]], others: set[str]) -> bool:
    """Whether `span` (`module.name`, `Class.attribute`, `module.Class.attribute`, `name`) names something that
    exists. A module is matched by the end of its dotted path (`memory.plan_run`, `trainer.memory.plan_run`)."""
    parts = span.removesuffix("()").split(".")
    import transformers

    external = {"transformers": transformers, "Trainer": transformers.Trainer,
                "TrainingArguments": transformers.TrainingArguments}
    if parts[0] in external:  # transformers' own API
        owner = external[parts[0]]
        for part in parts[1:]:
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True
    for cut in range(len(parts), 0, -1):
        head, rest = ".".join(parts[:cut]), parts[cut:]
        for module in (m for m in modules if m == head or m.endswith("." + head)):
            if not rest or (rest[0] in modules[module] and (len(rest) == 1 or set(rest[1:2]) <= classes.get(
                    rest[0], set()))):
                return True
    if parts[0] in classes:
        return len(parts) == 1 or parts[1] in classes[parts[0]]
    return len(parts) == 1 and (parts[0] in others or any(parts[0] in names for names in modules.values())
                                or any(parts[0] in attributes for attributes in classes.values()))


def test_every_name_in_architecture_md_exists():
    modules, classes = _definitions()
    others = _names_outside_the_package()
    spans = {s for s in _code_spans(ARCHITECTURE.read_text()) if _IDENTIFIER.match(s) and not _PATH.match(s)}
    # a plain lowercase word (`image`, a column) is prose; identifiers with `_`, `.` or capitals are names
    spans = {s for s in spans if re.search(r"[._A-Z]", s)}
    missing = sorted(s for s in spans if not _resolves(s, modules, classes, others))
    assert not missing, f"ARCHITECTURE.md names what does not exist: {missing}"


def test_every_path_in_architecture_md_exists():
    files = _repository_files()
    spans = {s for s in _code_spans(ARCHITECTURE.read_text()) if _PATH.match(s) and "<" not in s}
    missing = sorted(s for s in spans if not any(f == s or f.endswith("/" + s) for f in files))
    assert not missing, f"ARCHITECTURE.md points at paths that do not exist: {missing}"


def test_each_object_lives_where_architecture_md_says():
    # "`Name` (`path.py`)" and "`path.py` (`Name`)": Name is defined (not only imported) in that module
    modules, _ = _definitions()
    text = ARCHITECTURE.read_text()
    claims = re.findall(r"`([A-Z]\w+)` \(`([\w/]+)\.py`", text)
    claims += [(name, path) for path, name in re.findall(r"`([\w/]+)\.py` \(`([A-Z]\w+)`", text)]
    wrong = []
    for name, path in claims:
        dotted = path.removeprefix("grpo_trainer/").replace("/", ".")
        homes = [m for m in modules if m == dotted or m.endswith("." + dotted)]
        if not any(name in modules[m] for m in homes):
            wrong.append(f"{name} is not defined in {path}.py")
    assert claims and not wrong, wrong
