"""Structured outputs: a request's constraint (vLLM's ``StructuredOutputsParams``: a JSON schema, a regex, a choice,
an EBNF grammar, any JSON object, a structural tag) held to at every token it samples.

The grammar library is xgrammar (the ``structured`` extra; chosen by measurement, bench/structured_libs.py: on
SmolLM2's vocabulary it fills a mask in 2.5-8.5 us and makes a matcher in 5 us, llguidance in 32-91 us and 647 us).
The engine's ``Grammars`` hands the tokenizer's vocabulary to it once, checks a constraint when its request is
added (a constraint that cannot compile is refused then, with the library's reason: ``SamplingError``), and
compiles it in a thread of its own, off the step: the request is held out of the scheduler until its grammar is
ready (``Engine._held``), and a compiled grammar is kept by its text, so a constraint seen before is ready at once.
Each request then has a matcher (``Constrained``); a step fills the mask of every constrained row it samples and
applies it to their logits before anything else of the sampling pass (``masked``), and each token a request
takes advances its matcher; a grammar that ends ends the request (``stop``), one the model cannot finish within
``max_tokens`` ends with ``length``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedkv.shell.sampling import SamplingError, StructuredOutputsParams

KEPT = 512  # compiled grammars kept by their text (a few MB at most for schemas like the benchmark's)
# the longest run of whitespace between two of a JSON answer's tokens (xgrammar's ``max_whitespace_cnt``; vLLM leaves it
# unbounded): deep pretty-printed JSON needs less, and a small model's whitespace loop (sampled SmolLM2 wrote newlines
# to max_tokens in 1 of 200 answers) cannot run on
MAX_WHITESPACE = 32


class Grammars:
    """The engine's grammar compiler over its tokenizer's vocabulary (handed over once), each constraint compiled
    once, in a thread of its own, and kept by its text (module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError as e:  # (the extra is not installed: every constrained request is refused by name)
            raise SamplingError(
                f"structured_outputs needs xgrammar (pip install 'pagedkv[structured]'): {e}",
                parameter="structured_outputs",
            ) from None
        self.xgr = xgr
        self.vocab_size = vocab_size
        as_hf = getattr(tokenizer, "as_hf", None)  # (pagedkv's tokenizer; a Hugging Face one is taken as it is)
        self.info = xgr.TokenizerInfo.from_huggingface(as_hf() if as_hf else tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-grammar")
        self._lock = threading.Lock()
        self._compiled: dict[tuple[str, str, bool, bool], Future[Any]] = {}  # by key: done or on its way, the
        # most recently asked last; at most KEPT (a server's clients may send a new schema each request)

    def grammar(self, p: StructuredOutputsParams) -> Any:
        """The constraint as xgrammar's ``Grammar`` (no vocabulary: cheap), or ``SamplingError`` with the library's
        reason (``compile`` builds it once for each constraint it has not kept)."""
        xgr = self.xgr
        kind, text, compact, closed = p.key
        try:
            if kind == "json":
                schema = json.loads(text)
                if closed and isinstance(schema, dict):
                    schema = _closed(schema)
            elif kind == "json_object":
                schema = {"type": "object"}
            if kind in ("json", "json_object"):
                return xgr.Grammar.from_json_schema(
                    json.dumps(schema),
                    any_whitespace=not compact,
                    separators=(",", ":") if compact else None,
                    strict_mode=True,
                    max_whitespace_cnt=None if compact else MAX_WHITESPACE,
                )
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
                )
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(text)
            return xgr.Grammar.from_structural_tag(text)
        except Exception as e:  # noqa: BLE001 - the library's reason, whatever its class, is the refusal's
            why = (
                re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__
            )
            raise SamplingError(
                f"structured_outputs.{kind} cannot be compiled: {why}", parameter="structured_outputs", value=kind
            ) from None

    def compile(self, p: StructuredOutputsParams) -> Future[Any]:
        """The compiled grammar of ``p``, on its way (a thread compiles it) or ready (seen before); ``SamplingError``
        at once for a constraint that cannot compile (``grammar``): what the engine checks when a request is added."""
        key = p.key
        with self._lock:
            got = self._compiled.pop(key, None)
            if got is None or (got.done() and got.exception() is not None):
                got = self._pool.submit(self.compiler.compile_grammar, self.grammar(p))
            self._compiled[key] = got  # (the most recently asked last)
            if len(self._compiled) > KEPT:  # the least recently asked that is done goes (a request holds its own)
                old = next((k for k, f in self._compiled.items() if f.done()), None)
                if old is not None:
                    del self._compiled[old]
        return got

    def matcher(self, compiled: Any) -> Constrained:
        return Constrained(self.xgr.GrammarMatcher(compiled))

    def masked(self, logits: torch.Tensor, rows: Sequence[tuple[int, Constrained, Sequence[int]]]) -> torch.Tensor:
        """``logits`` with the ids each constrained request's grammar does not allow out of reach (``-inf``): ``rows``
        holds (its first logits row, its matcher, its drafts), and a request verifying drafts has a row a position,
        the j-th masked as its grammar stands after the first j drafts. The masks are filled on the host and applied
        where the logits are, unpacked by torch's ops (1.3 ms at 16 rows of 49,152 ids on this 2-core CPU, where
        xgrammar's ``apply_token_bitmask_inplace`` takes 3.7)."""
        xgr = self.xgr
        at = [first + j for first, _, drafts in rows for j in range(1 + len(drafts))]
        mask = xgr.allocate_token_bitmask(len(at), self.vocab_size)
        k = 0
        for _, c, drafts in rows:
            c.matcher.fill_next_token_bitmask(mask, k)
            k += 1
            for t in drafts:  # (``drafts_kept`` cut them where the grammar refuses: each is taken)
                c.matcher.accept_token(t)
                c.matcher.fill_next_token_bitmask(mask, k)
                k += 1
            if drafts:
                c.matcher.rollback(len(drafts))
        dev, vocab = logits.device, logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32, device=dev)  # (the mask's bits, lowest first, as xgrammar packs)
        allowed = ((mask.to(dev).unsqueeze(-1) >> shifts) & 1).view(len(at), -1)[:, :vocab].bool()
        if len(at) < logits.shape[0]:  # (rows not constrained keep every id)
            keep = torch.ones(logits.shape, dtype=torch.bool, device=dev)
            keep[torch.tensor(at, dtype=torch.int64, device=dev)] = allowed
            allowed = keep
        return logits.float().masked_fill(~allowed, float("-inf"))  # (a new tensor: the logits may be a graph's)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` on every object that does not say (vLLM's
    ``disable_additional_properties``)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    closed: dict[str, Any] = walk(schema)
    return closed


class Constrained:
    """One request's place in its grammar: its matcher, advanced by each token the request takes."""

    __slots__ = ("matcher", "ended")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.ended = False  # the grammar is complete: nothing more may follow

    def drafts_kept(self, drafts: tuple[int, ...]) -> tuple[int, ...]:
        """``drafts`` cut before the first the grammar refuses (and after one that ends it): what a verify may try."""
        n = 0
        for t in drafts:
            if self.ended or not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            self.matcher.rollback(n)
        return drafts[:n]

    def accept(self, token: int) -> bool:
        """Take ``token``; does the grammar end with it (or refuse it: then nothing more may follow either)?"""
        if self.ended:
            return True
        if not self.matcher.accept_token(token):
            self.ended = True
            return True
        self.ended = self.matcher.is_terminated()
        return self.ended
