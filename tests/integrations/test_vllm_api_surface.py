"""docs/vllm-api.md against vLLM's own classes (0.33 and 0.34 in CI): every public field of vLLM's
``SamplingParams``, every public method of its ``LLM``, has a row there that says served or refused."""

from __future__ import annotations

import pytest

from tests.app.test_vllm_api import page_tables

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (CI: .ci/vllm_env.sh)")


def test_every_public_sampling_params_field_of_vllm_has_a_row() -> None:
    import dataclasses

    from vllm import SamplingParams

    fields = getattr(SamplingParams, "__struct_fields__", None) or [f.name for f in dataclasses.fields(SamplingParams)]
    public = {f for f in fields if not f.startswith("_")}
    rows = page_tables()["SamplingParams"]
    assert public <= set(rows), sorted(public - set(rows))


def test_every_public_method_of_vllms_llm_has_a_row() -> None:
    from vllm import LLM

    public = {m for m in dir(LLM) if not m.startswith("_") and callable(getattr(LLM, m))}
    rows = page_tables()["LLM"]
    assert public <= set(rows), sorted(public - set(rows))


def test_structured_outputs_params_has_vllms_fields_and_defaults() -> None:
    """pagedkv's ``StructuredOutputsParams`` is vLLM's: every public field, with vLLM's default (issue 65)."""
    import dataclasses

    from vllm.sampling_params import StructuredOutputsParams as Theirs

    from pagedkv.sampling_params import StructuredOutputsParams as Ours

    def public(cls: type) -> dict[str, object]:
        return {f.name: f.default for f in dataclasses.fields(cls) if not f.name.startswith("_")}

    assert public(Ours) == public(Theirs)
