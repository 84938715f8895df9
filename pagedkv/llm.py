"""``pagedkv.llm.LLM``: the whole-request API (``pagedkv.app.llm``) under its first module path."""

from pagedkv.app.llm import LLM

__all__ = ["LLM"]
