"""What pagedkv's vLLM manager reads of a vLLM ``Request``: the extra keys its blocks hash, as vLLM's
``generate_block_hash_extra_keys`` builds them (a LoRA adapter on every block, each multimodal input on the
blocks it touches, the cache salt on the first block), the fields its KV events carry (the adapter's id and
name, the session), how much of the prefix cache it may read (each release's field: ``version``), and why it is
freed."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import cache
from typing import Any

from pagedkv.core.rules.hashing import Content, Key
from pagedkv.integrations.vllm import version
from pagedkv.integrations.vllm.events import RequestFields


class RefusedRequest(ValueError):
    """A request pagedkv's vLLM manager cannot hash as vLLM does (prompt embeddings)."""


def block_keys(request: Any) -> tuple[tuple[Key, ...], tuple[Content, ...], tuple[Key, ...]]:
    """(every block's keys, content spans, the first block's keys) of a vLLM request, in vLLM's order."""
    if request.prompt_embeds is not None:
        raise RefusedRequest(
            f"request {request.request_id!r}: prompt embeddings are not served by pagedkv's KV "
            "cache manager (their blocks hash tensor data)"
        )
    lora = request.lora_request
    every: tuple[Key, ...] = (("lora", lora.lora_name, lora.lora_path),) if lora else ()
    content = tuple(
        (f.identifier, f.mm_position.offset, f.mm_position.length)
        for f in request.mm_features or ()
        if f.identifier is not None
    )
    first: tuple[Key, ...] = (("cache_salt", request.cache_salt),) if request.cache_salt else ()
    return every, content, first


_WIDE = 256  # (from this many ids on, numpy's fixed ~5 us pays)


def token_ids(request: Any, start: int = 0, stop: int | None = None) -> Sequence[int]:
    """The request's token ids ``[start, stop)`` as an ``array("Q")``, which the core takes with no per-id check
    (each id converted, and so checked, here). vLLM 0.34 keeps a request's ids in an ``array("i")`` (its
    ``TokenBuffer``), whose slices are made into lists: its ids are widened from the buffer at C speed where they are many
    (numpy, which vLLM installs; ~7 us for 8,192 ids against ~290 for a slice); 0.33's, a list, is converted as it is. Ids that
    are no token ids (a negative one) come back as a list, for the core to refuse naming the first."""
    buf = request._all_token_ids
    stop = len(buf) if stop is None else min(stop, len(buf))
    if stop <= start:
        return array("Q")
    if stop - start >= _WIDE and isinstance(buf, array) and buf.typecode == "i":
        import numpy as np  # (vLLM's own dependency: this manager exists only where vLLM does)

        wide = np.frombuffer(buf, dtype=np.int32, count=stop - start, offset=start * 4)
        if wide.min() < 0:
            return list(buf[start:stop])
        out = array("Q")
        out.frombytes(wide.astype("<u8").tobytes())
        return out
    part = buf[start:stop]
    try:
        return array("Q", part)
    except (OverflowError, TypeError):
        return list(part)


def event_fields(request: Any) -> RequestFields:
    """What vLLM's ``BlockStored`` carries of the request that stored the blocks."""
    lora = request.lora_request
    return RequestFields(
        lora.adapter_id if lora else None, lora.name if lora else None, getattr(request, "session_id", None)
    )


def reads_cache(request: Any) -> bool:
    """May the request read the prefix cache at all? vLLM 0.34: its ``prefix_cache_hit_limit`` is not 0; 0.33: it
    does not ``skip_reading_prefix_cache`` (prompt logprobs set it, unless the request says otherwise)."""
    if version.at_least("0.34"):
        return bool(request.prefix_cache_hit_limit != 0)
    return not request.skip_reading_prefix_cache


def hit_limit(request: Any, bound: int | None = None) -> int:
    """The most tokens a prefix hit may hold for the request, ``bound`` (the scheduler's) tightening it: vLLM
    0.34's ``get_max_cache_hit_length`` (the last token always recomputed, and a request scoring its prompt from
    ``prompt_logprob_start`` reads no further), 0.33's ``num_tokens - 1`` or the bound given."""
    if version.at_least("0.34"):
        return int(request.get_max_cache_hit_length(bound))
    return int(request.num_tokens - 1 if bound is None else bound)


def is_waiting(request: Any) -> bool:
    status = _vllm_request().RequestStatus
    return request.status in (status.WAITING, status.PREEMPTED)


def release_reason(request: Any) -> str:
    status = _vllm_request().RequestStatus
    if request.status == status.FINISHED_ABORTED:
        return "cancelled"
    if status.is_finished(request.status):
        return "finished"
    return "preempted"


@cache
def _vllm_request() -> Any:
    import vllm.v1.request  # (looked up once: the manager exists only where vLLM does)

    return vllm.v1.request
