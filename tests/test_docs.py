"""Issue 46: docs that run. Every Python block of README.md and docs/*.md is executed here, a page's blocks in
order in one namespace (as a reader runs them), in a scratch folder; a snippet can no longer drift from the
library. A block whose first line says ``# needs cuda: ...``, ``# needs vllm: ...`` or ``# needs vllm-omni: ...`` runs where that is at hand
and is skipped, with its reason, where it is not (the blocks after it on its page too: they may use its names)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"# needs (cuda|vllm-omni|vllm): (.+)")
PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if BLOCK.search(p.read_text())]


def blocks(page: Path) -> list[tuple[int, str]]:
    """Each Python block of ``page``: (its first line's number, its code)."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def missing(need: str) -> bool:
    if need == "cuda":
        import torch

        return not torch.cuda.is_available()
    try:
        if need == "vllm-omni":
            import vllm_omni.diffusion.diffusion_kv.manager  # noqa: F401
        else:
            import vllm  # noqa: F401
    except ImportError:
        return True
    return False


def test_the_pages_with_code_are_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "engine.md", "index.md", "scheduler.md", "shell.md", "diffusion.md"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_python_block_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # (a block that writes a file writes it here)
    namespace: dict[str, object] = {"__name__": "__main__"}  # (as a script a reader saves the blocks to)
    for line, code in blocks(page):
        need = NEEDS.match(code)
        if need is not None and missing(need.group(1)):
            pytest.skip(f"{page.name} line {line} needs {need.group(1)}: {need.group(2)}")
        exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102 - the docs' own code
