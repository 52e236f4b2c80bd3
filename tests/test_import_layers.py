"""Import-layer contracts of the package, from every module's imports as written (``ast``).

Every import counts: module level, inside functions (lazy imports) and under ``if TYPE_CHECKING:``.
A lazy import still couples two modules; a cycle through one only hides until someone moves it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dspark_server"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# (importer prefix, forbidden import prefixes): a prefix names a module or a whole subpackage.
FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "models",
        ("engine", "server", "bench", "jobs", "backends", "training", "cli", "offline", "planner"),
    ),
    ("engine", ("server", "bench", "jobs", "backends", "training", "cli")),
    ("server", ("bench", "jobs", "training", "cli")),
    ("config", ("models", "engine", "server", "bench", "jobs", "backends", "training", "planner", "cli")),
)


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of the package that ``name`` (a module or a name inside one) refers to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that ``module`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import name` imports mod.
            targets = [f"{prefix}.{alias.name}" for alias in node.names]
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                resolved = _resolve(target, modules)
                if resolved and resolved != module:
                    found.add(resolved)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _under(module: str, prefix: str) -> bool:
    full = f"{PACKAGE}.{prefix}"
    return module == full or module.startswith(full + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if _under(module, "planner") and not _under(target, "planner"):
                bad.append(f"{module} -> {target} (planner/ imports nothing else of {PACKAGE})")
            if _under(target, "cli"):
                bad.append(f"{module} -> {target} (cli.py is the top: nothing imports it)")
            for importer, forbidden in FORBIDDEN:
                if _under(module, importer):
                    bad += [
                        f"{module} -> {target} ({importer} never imports {f})"
                        for f in forbidden
                        if _under(target, f)
                    ]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The parser finds module-level, lazy, TYPE_CHECKING and relative imports."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dspark_server.sub.b import X\n"
    )
    (pkg / "sub" / "b.py").write_text("def f():\n    from .a import g\n    import dspark_server.c\n")
    (pkg / "c.py").write_text("from dspark_server.sub import a\n")
    graph = import_graph(pkg)
    assert graph["dspark_server.sub.a"] == {"dspark_server.sub.b"}
    assert graph["dspark_server.sub.b"] == {"dspark_server.sub.a", "dspark_server.c"}
    assert graph["dspark_server.sub"] == {"dspark_server.sub.b"}
    assert graph["dspark_server.c"] == {"dspark_server.sub.a"}
    assert cycles(graph) == [["dspark_server.c", "dspark_server.sub.a", "dspark_server.sub.b"]]


def test_planted_violations_are_caught() -> None:
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph["dspark_server.models.target"].add("dspark_server.engine.request")
    graph["dspark_server.planner.sps"].add("dspark_server.config")
    graph["dspark_server.bench.main"].add("dspark_server.cli")
    graph["dspark_server.engine.batch"].add("dspark_server.server.protocol")
    bad = "\n".join(layer_violations(graph))
    for edge in (
        "models.target -> dspark_server.engine.request",
        "planner.sps -> dspark_server.config",
        "bench.main -> dspark_server.cli",
        "engine.batch -> dspark_server.server.protocol",
    ):
        assert edge in bad
    graph["dspark_server.config"].add("dspark_server.cli")
    assert any("dspark_server.config" in c and "dspark_server.cli" in c for c in cycles(graph))


def test_the_package_never_imports_the_repository_tools() -> None:
    bad = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{name} -> {n}" for n in names if n == "tools" or n.startswith("tools.")]
    assert not bad, "tools/ is not installed with the package:\n" + "\n".join(bad)


def test_layers() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "import-layer violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("root", [ROOT], ids=[PACKAGE])
def test_no_import_cycles(root: Path) -> None:
    found = cycles(import_graph(root))
    assert not found, "import cycles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
