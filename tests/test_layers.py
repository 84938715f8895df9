"""The house: every import points down (core <- shell <- models <- app) and no modules import each
other in a circle. Imports inside functions count too: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pagedkv"
LAYERS = ("core", "shell", "models", "app")  # each may import only those before it


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The pagedkv modules ``name`` imports anywhere in its source (``from a import b``: the module
    ``a.b`` when there is one, else ``a``)."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != name}


def layer(name: str) -> int:
    """0 core, 1 shell, 2 models, 3 app; the package root and its re-exporting shims sit with the app."""
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS) - 1


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer(b) > layer(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def test_every_import_points_down() -> None:
    assert back_arrows(graph()) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert cycles(graph()) == []


def test_the_checks_catch_a_back_arrow_and_a_circle() -> None:
    g = graph()
    g["pagedkv.core.store.state"] = g["pagedkv.core.store.state"] | {"pagedkv.shell.worker"}  # the core reaching up
    g["pagedkv.shell.pool"] = g["pagedkv.shell.pool"] | {"pagedkv.shell.rank"}  # rank imports pool: a circle
    assert back_arrows(g) == ["pagedkv.core.store.state -> pagedkv.shell.worker"]
    assert any({"pagedkv.shell.pool", "pagedkv.shell.rank"} <= set(c) for c in cycles(g))


def test_lazy_and_relative_imports_are_seen(tmp_path: Path) -> None:
    pkg = tmp_path / "pagedkv"
    (pkg / "core").mkdir(parents=True)
    (pkg / "app").mkdir()
    for p in (pkg / "__init__.py", pkg / "core" / "__init__.py", pkg / "app" / "__init__.py", pkg / "app" / "cli.py"):
        p.write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ..app import cli\n    from . import b\n")
    (pkg / "core" / "b.py").write_text("import pagedkv.core.a\n")
    mods = modules(pkg)
    g = {n: imports(n, p, mods) for n, p in mods.items()}
    assert g["pagedkv.core.a"] == {"pagedkv.app.cli", "pagedkv.core.b"}
    assert back_arrows(g) == ["pagedkv.core.a -> pagedkv.app.cli"]
    assert cycles(g) == [["pagedkv.core.a", "pagedkv.core.b"]]


SHADOW_CHECK = """
import importlib, pkgutil, pagedkv
found = list(pkgutil.walk_packages(pagedkv.__path__, "pagedkv."))
packages = ["pagedkv", *(m.name for m in found if m.ispkg)]
names = {p: dict(vars(importlib.import_module(p))) for p in packages}
for m in found:
    importlib.import_module(m.name)
print([f"{p}.{k}" for p in packages for k, v in names[p].items() if vars(importlib.import_module(p)).get(k) is not v])
"""


def test_importing_a_module_never_shadows_a_package_name() -> None:
    """A name a package exports and a submodule of that name would collide (the package's ``digest``
    function was once shadowed so): loading every module (as ``--doctest-modules`` does) must leave each
    package's names as they were. In a fresh interpreter, so that what this session imported before cannot
    hide it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SHADOW_CHECK], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"a submodule import rebinds {out.stdout.strip()}"
