"""The core stays pure: nothing under pagedkv/core imports anything impure."""

import ast
from pathlib import Path

import pagedkv.core

CORE = Path(pagedkv.core.__file__).parent
FORBIDDEN = {
    "torch",
    "numpy",
    "os",
    "time",
    "random",
    "sys",
    "subprocess",
    "threading",
    "datetime",
    "socket",
    "pathlib",
    "io",
    "pagedkv.shell",
    "pagedkv.models",
    "pagedkv.app",
}


def impure_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN):
                found.append(name)
    return found


def test_core_imports_nothing_impure() -> None:
    files = sorted(CORE.rglob("*.py"))  # the subpackages too (scheduler/, verify/)
    assert len(files) >= 8 and any(f.parent.name == "scheduler" for f in files)
    bad = {str(f.relative_to(CORE)): impure_imports(f.read_text()) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_checker_catches_a_planted_import() -> None:
    assert impure_imports("import os\nfrom torch import nn\nimport json\n") == ["os", "torch"]
    assert impure_imports("def f():\n    import time.perf_counter\n") == ["time.perf_counter"]
    assert impure_imports("from pagedkv.shell.worker import Worker\n") == ["pagedkv.shell.worker"]
    assert impure_imports("import numpyish\nfrom . import os\n") == []
