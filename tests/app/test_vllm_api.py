"""docs/vllm-api.md against pagedkv's code: every row of its tables says what the code does (served or refused by
name), and every public field of pagedkv's ``SamplingParams`` has a row. (tests/integrations/test_vllm_api_surface.py
checks the same tables against vLLM's own classes, where vLLM is installed.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm-api.md"


def page_tables() -> dict[str, dict[str, str]]:
    """Each ``## section``'s table rows: ``{name: "served" | "refused" | "not served"}``."""
    tables: dict[str, dict[str, str]] = {}
    section = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `([A-Za-z_]+)` \| (served|refused|not served) \|", line)
        if m:
            rows = tables.setdefault(section, {})
            assert m.group(1) not in rows, f"{m.group(1)} twice in {section}"
            rows[m.group(1)] = m.group(2)
    return tables


def test_every_sampling_params_field_has_a_row_that_says_what_the_code_does() -> None:
    from pagedkv.shell.sampling import NOT_SERVED, SamplingError, SamplingParams

    rows = page_tables()["SamplingParams"]
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(rows) == fields
    for name, status in rows.items():
        assert (status == "refused") == (name in NOT_SERVED), name
        if status == "refused":  # (refused by name when built, with any value but the one meaning "not used")
            with pytest.raises(SamplingError, match=name) as raised:
                SamplingParams(**{name: 7 if NOT_SERVED[name] is None else object()})
            assert raised.value.parameter == name


def test_every_llm_row_says_what_the_class_has() -> None:
    from pagedkv import LLM

    rows = page_tables()["LLM"]
    for name, status in rows.items():
        assert (status == "served") == callable(getattr(LLM, name, None)), name
    public = {m for m in dir(LLM) if not m.startswith("_")}
    assert public <= set(rows), public - set(rows)


def test_every_server_row_says_what_the_server_does() -> None:
    from pagedkv.app.openai_api import FIELDS, NOT_SERVED

    rows = page_tables()["Server"]
    read_apart = {"logprobs", "top_logprobs", "chat_template", "chat_template_kwargs", "continue_final_message",
                 "add_generation_prompt", "request_id", "echo",
                 "response_format", "structured_outputs"}  # (read by openai_api._constraint)  # fmt: skip
    for name, status in rows.items():
        if status == "refused":
            assert name in NOT_SERVED, name
        else:
            assert name not in NOT_SERVED and (name in FIELDS or name in read_apart), name
    assert set(FIELDS) <= set(rows)


def test_the_vllm_names_are_exported_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pagedkv; assert 'torch' not in sys.modules; "
        "from pagedkv import LLM, SamplingParams, TokensPrompt, TextPrompt, RequestOutput, CompletionOutput, "
        "RequestOutputKind, VLLMValidationError, EngineArgs; "
        "assert issubclass(VLLMValidationError, ValueError); print(sorted(pagedkv.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'LLM'" in out and "'SamplingParams'" in out
