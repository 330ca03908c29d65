"""The layering of docs/architecture.md that a change could quietly undo, read from the imports themselves (all of
them, the lazy ones inside functions included): the runtime never imports the dev tools, ``pf_trl.attention`` never
imports the trainer, no import cycle beyond the ones other work is removing, and the wheel ships no dev tools."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("pf_trl", "preprocess_service")
# issue 24: cycles other branches are removing; delete an entry when its cycle is gone (a new cycle fails)
KNOWN_CYCLES: set[frozenset[str]] = set()  # none: any cycle fails


def _modules(*packages: str) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module name ``path`` imports (``from a import b`` names ``a`` and ``a.b``), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ``modules`` it imports (a name resolved to its nearest module)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in _imports(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return out


def _importers(prefix: str, of: str) -> list[str]:
    """``module: imported`` for every module under ``prefix`` that imports something under ``of``."""
    found = []
    for name, path in _modules(*RUNTIME).items():
        if name == prefix or name.startswith(prefix + "."):
            found += [f"{name}: {t}" for t in sorted(_imports(name, path)) if t == of or t.startswith(of + ".")]
    return found


def test_the_import_reader_sees_lazy_and_relative_imports():
    # negative control: imports this test must see, or the assertions below could not fail
    assert _importers("pf_trl.cli", "pf_trl.trainer")  # pf-trl train builds the trainer (inside functions)
    assert "pf_trl.attention.enable" in _imports("pf_trl.attention", ROOT / "pf_trl/attention/__init__.py")
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == {frozenset("abc")}


def test_the_runtime_never_imports_the_dev_tools():
    assert not _importers("pf_trl", "pf_trl_dev") + _importers("preprocess_service", "pf_trl_dev")


def test_attention_never_imports_the_trainer():
    assert not _importers("pf_trl.attention", "pf_trl.trainer")


def test_no_import_cycle_beyond_the_known_ones():
    graph = _graph(_modules(*RUNTIME))
    new = _cycles(graph) - KNOWN_CYCLES
    assert not new, f"import cycles: {[sorted(c) for c in new]}"
    top = {}  # the same at the level of pf_trl's subpackages (pf_trl.data, pf_trl.attention...)
    for name, targets in graph.items():
        unit = ".".join(name.split(".")[:2])
        top.setdefault(unit, set()).update(".".join(t.split(".")[:2]) for t in targets)
    for unit, targets in top.items():
        targets.discard(unit)
    new = _cycles(top) - KNOWN_CYCLES
    assert not new, f"cycles between packages: {[sorted(c) for c in new]}"


def test_the_wheel_ships_no_dev_tools():
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_packages(where=str(ROOT), include=find["include"]))
    assert {"pf_trl", "pf_trl.attention", "pf_trl.data", "preprocess_service"} <= packages
    assert not {p for p in packages if p.split(".")[0] == "pf_trl_dev"}, packages
    assert (ROOT / "pf_trl_dev" / "__init__.py").is_file()  # the checkout has them: the test would see them
