"""Issue 64's goal: scripts written the way vLLM's documentation examples are (tests/app/vllm_scripts/), with
``vllm`` replaced by ``pagedkv`` in their imports and nothing else changed, run and give what vLLM's give in
kind: ``RequestOutput``s of vLLM's fields and types, vLLM's finish reasons, the openai client's objects from the
server. The offline scripts share the session's one SmolLM2 load (``Llama.smollm2`` answers with it); the client
scripts reach a server of this module (their ``http://localhost:8000/v1`` pointed at it)."""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.test_serve import Served, served  # noqa: F401 - the module's server

SCRIPTS = Path(__file__).parent / "vllm_scripts"
OFFLINE = sorted(p.name for p in SCRIPTS.glob("*.py") if not p.name.startswith("openai_"))
CLIENT = sorted(p.name for p in SCRIPTS.glob("openai_*.py"))
REASONS = {"stop", "length"}


@pytest.fixture
def one_load(smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from pagedkv.models.llama import Llama

    monkeypatch.setattr(Llama, "smollm2", classmethod(lambda cls, **kw: smollm2))
    yield


def check_kind(value: Any) -> int:
    """vLLM's shape, field by field, of every RequestOutput in ``value``: how many there were."""
    from pagedkv import CompletionOutput, RequestOutput

    if isinstance(value, list):
        return sum(check_kind(v) for v in value)
    if isinstance(value, CompletionOutput):
        assert isinstance(value.index, int) and isinstance(value.text, str) and value.finish_reason in REASONS
        assert all(type(t) is int for t in value.token_ids)
        assert value.stop_reason is None or isinstance(value.stop_reason, (str, int))
        return 1
    if not isinstance(value, RequestOutput):
        return 0
    assert isinstance(value.request_id, str) and (value.prompt is None or isinstance(value.prompt, str))
    assert isinstance(value.prompt_token_ids, list) and all(type(t) is int for t in value.prompt_token_ids)
    assert value.finished is True and isinstance(value.num_cached_tokens, int)
    scored = value.prompt_logprobs
    assert scored is None or (len(scored) == len(value.prompt_token_ids) and scored[0] is None)
    assert value.metrics is not None and value.metrics.num_generation_tokens == sum(
        len(c.token_ids) for c in value.outputs
    )
    for i, c in enumerate(value.outputs):
        assert isinstance(c, CompletionOutput) and c.index == i and isinstance(c.text, str)
        assert all(type(t) is int for t in c.token_ids) and c.finish_reason in REASONS, c
        assert c.stop_reason is None or isinstance(c.stop_reason, (str, int))
        assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
    return 1


@pytest.mark.parametrize("name", OFFLINE)
def test_a_vllm_offline_script_runs_unchanged(name: str, one_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    code = [line for line in (SCRIPTS / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not any("vllm" in line for line in code)  # (the import replaced)
    namespace = runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    printed = capsys.readouterr().out
    assert printed.strip(), name
    found = sum(check_kind(v) for v in namespace.values())
    assert found or name in ("validation.py",), f"{name} left no RequestOutput to check"


@pytest.mark.parametrize("name", CLIENT)
def test_a_vllm_client_script_runs_unchanged_against_the_server(
    name: str,
    served: Served,
    capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    source = (SCRIPTS / name).read_text().replace("http://localhost:8000/v1", f"{served.url}/v1")
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - the script, its URL pointed at this server
    printed = capsys.readouterr().out
    assert printed.strip(), name
    for value in namespace.values():
        choices = getattr(value, "choices", None)
        if isinstance(choices, list) and getattr(value, "object", "") != "chat.completion.chunk":
            assert choices and all(c.finish_reason in REASONS for c in choices), value
