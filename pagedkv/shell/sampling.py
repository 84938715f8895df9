"""Sampling: a token for every sampled row of a step, on the logits' device, in one pass.

Penalties first (vLLM's, on the model's logits: ``repetition_penalty`` over the prompt's and the output's ids,
``presence_penalty`` and ``frequency_penalty`` over the output's; stop tokens held back before ``min_tokens``),
then greedy rows take the argmax. A sampled row scales by its temperature, keeps its top-k and its
top-p nucleus, and draws by the exponential race: the token with the largest ``p / E``, where
``E`` is an exponential variate that a counter-based hash gives for (the request's seed, how many
tokens it has drawn, the token id). The noise depends on nothing else, so a seeded request draws
the same tokens batched or alone, on any batch order, and no generator object is kept: the whole
batch is sampled with a few tensor operations and one device-to-host copy (``sample_batch``). Logprobs, where a
request asks them, come from the same logits in one more pass (``token_logprobs``).
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

import torch

from pagedkv.core.errors import shown
from pagedkv.shell.transfer import to_device

_M32 = 0xFFFFFFFF


MAX_LOGPROBS = 20  # the most top logprobs a token may ask (vLLM's max_logprobs default)
MAX_N = 256  # the most sequences a prompt may ask


class SamplingError(ValueError):
    """A sampling parameter out of its range, or one pagedkv does not serve, refused when ``SamplingParams`` is built
    (vLLM's ``VLLMValidationError``, which pagedkv also exports under that name: a ``ValueError``, so handlers written
    for either of vLLM's error classes catch it). ``parameter`` names the field."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class RequestOutputKind(IntEnum):
    """vLLM's: what ``LLM`` and a stream hand out of a request (pagedkv's ``LLM`` hands out the finished whole)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one constraint (``json``: a JSON schema, as a dict or its text;
    ``regex``; ``choice``: the strings it may be; ``grammar``: EBNF (GBNF's form, as xgrammar and llama.cpp read it);
    ``json_object``: any JSON object; ``structural_tag``: xgrammar's structural tag, as JSON text), and the options
    a JSON schema is compiled with (``disable_any_whitespace``: no whitespace between its tokens;
    ``disable_additional_properties``: no property the schema does not name; ``whitespace_pattern`` is not served
    by xgrammar and is refused, as vLLM's xgrammar backend does).

    >>> StructuredOutputsParams(choice=["yes", "no"]).kind
    'choice'
    >>> StructuredOutputsParams(regex="a+", choice=["a"])
    Traceback (most recent call last):
    ...
    pagedkv.shell.sampling.SamplingError: structured_outputs: one kind of constraint, not 2 (regex, choice)
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _key: tuple[str, str, bool, bool] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise SamplingError(
                f"structured_outputs: one kind of constraint, not {len(given)}"
                + (f" ({', '.join(given)})" if given else f" (one of {', '.join(KINDS)})"),
                parameter="structured_outputs",
                value=given,
            )
        self._key = None
        self.key  # noqa: B018 - every field's type checked now, the text made once

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """(kind, its text, disable_any_whitespace, disable_additional_properties): what a compiled grammar is kept
        by."""
        if self._key is None:
            self._key = (self.kind, _text(self), bool(self.disable_any_whitespace), self.disable_additional_properties)
        return self._key

    def as_dict(self) -> dict[str, Any]:
        """The fields set, as JSON (the trace's record of the constraint; ``of`` reads it back)."""
        kind, text, compact, closed = self.key
        out: dict[str, Any] = {kind: json.loads(text) if kind in ("json", "choice") else text}
        if kind == "json_object":
            out[kind] = True
        if compact:
            out["disable_any_whitespace"] = True
        if closed:
            out["disable_additional_properties"] = True
        return out

    @staticmethod
    def of(value: object) -> StructuredOutputsParams:
        """``value`` as the params: the params themselves, or a mapping of their fields (what a server's request and
        ``extra_body`` send); ``SamplingError`` naming what is wrong."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise SamplingError(
                f"structured_outputs must be StructuredOutputsParams or a mapping of its fields, got {type(value).__name__}",
                parameter="structured_outputs",
                value=value,
            )
        known = {k for k in StructuredOutputsParams.__dataclass_fields__ if not k.startswith("_")}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SamplingError(
                f"structured_outputs has no field {', '.join(map(str, unknown))} (its fields: {', '.join(sorted(known))})",
                parameter="structured_outputs",
                value=value,
            )
        return StructuredOutputsParams(**value)


def _text(p: StructuredOutputsParams) -> str:
    """The constraint as the text it compiles from (a schema's JSON with sorted keys, a choice's list as JSON), its
    fields' types checked."""

    def bad(what: str) -> SamplingError:
        return SamplingError(f"structured_outputs.{what}", parameter="structured_outputs", value=p.kind)

    for name in ("disable_any_whitespace", "disable_additional_properties"):
        if type(getattr(p, name)) is not bool:
            raise bad(f"{name} must be true or false")
    if p.whitespace_pattern is not None:
        raise bad("whitespace_pattern is not served (xgrammar has none; vLLM's xgrammar backend refuses it too)")
    kind = p.kind
    if kind == "json":
        schema = p.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad(f"json is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
        return json.dumps(schema)  # (its properties in the order given: the order the object's fields are made in)
    if kind == "choice":
        if not isinstance(p.choice, (list, tuple)) or not p.choice or not all(type(c) is str for c in p.choice):
            raise bad("choice must be a non-empty list of strings")
        return json.dumps(list(p.choice))
    if kind == "json_object":
        if p.json_object is not True:
            raise bad("json_object must be true when given")
        return ""
    value = getattr(p, kind)
    if type(value) is not str or not value:
        raise bad(f"{kind} must be a non-empty string")
    return str(value)


# vLLM's fields that pagedkv does not serve, each with the value that means it is not used: any other value is
# refused by name when the params are built (docs/vllm-api.md says why each is not served)
NOT_SERVED: dict[str, Any] = {
    "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None,
    "logprob_token_ids": None,
    "flat_logprobs": False,
    "spaces_between_special_tokens": True,
    "extra_args": None,
    "bad_words": None,
    "skip_reading_prefix_cache": None,
    "watermarking": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
    "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
    "output_text_buffer_length": 0,
}


@dataclass(slots=True)
class SamplingParams:
    """How a request samples: vLLM's ``SamplingParams``, its fields, defaults and meaning (``temperature`` 1.0,
    ``max_tokens`` 16; ``max_tokens=None``: up to the model's length), checked when built (``SamplingError``) and
    settable in place as vLLM's are (the engine takes a checked copy of them when a request is added).

    ``stop`` takes a string or any sequence of strings; ``n`` sequences a prompt (``LLM`` fans them out, the i-th
    seeded ``seed + i``; ``Engine.add_request`` takes one); ``repetition_penalty`` (1: off) divides a positive logit
    and multiplies a negative one of every id in the prompt or the output, ``presence_penalty`` and
    ``frequency_penalty`` (0: off, in [-2, 2]) subtract once a present id and once an occurrence of the output's
    ids; ``top_k`` (0 or -1: off), ``top_p``, ``min_p`` (ids less likely than ``min_p`` times the likeliest are
    dropped); ``min_tokens``: no stop (token or string) before that many tokens; ``ignore_eos``: the
    end-of-sequence tokens do not end it (stop strings still do); ``logprobs``: each generated token's logprob and
    those of the ``logprobs`` most likely ids, from the model's logits (before penalties and temperature, vLLM's raw
    logprobs; -1: every id, as vLLM: refused past 20 here), on the completion; ``stop_token_ids``: ids that end it
    besides the model's (kept in its tokens, ``stop_reason`` the id; held back before ``min_tokens``, and
    ``ignore_eos`` leaves them stopping); ``prompt_logprobs``: each prompt token's logprob given the tokens before it
    and those of the k most likely ids there (vLLM's; the first token's None; such a request reads no prefix cache,
    as vLLM's, for every position is computed); ``include_stop_str_in_output``: the stop string that ended it stays in its
    text; ``logit_bias``: ``{token id: bias}`` added to those ids' logits before anything else (OpenAI's range,
    [-100, 100]); ``allowed_token_ids``: the only ids it may sample; ``detokenize`` False: no text, ids alone;
    ``skip_special_tokens`` False: special tokens' text kept; ``truncate_prompt_tokens``: only the prompt's last k
    tokens are served (-1: as many as the model's length takes; ``LLM``'s); ``output_kind``: vLLM's (``LLM`` hands
    out finished requests: ``CUMULATIVE`` and ``FINAL_ONLY`` mean that there); ``structured_outputs``: a
    ``StructuredOutputsParams`` (or a mapping of its fields) whose constraint every token keeps to
    (``shell/structured.py``). The fields in ``NOT_SERVED`` are
    refused by name unless they hold the value meaning they are not used.

    >>> p = SamplingParams(max_tokens=8)
    >>> p.temperature, p.max_tokens, p.stop
    (1.0, 8, ())
    >>> SamplingParams(top_p=0)
    Traceback (most recent call last):
    ...
    pagedkv.shell.sampling.SamplingError: top_p must be a number in (0, 1], got 0
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1): off
    min_p: float = 0.0
    seed: int | None = None  # per request: the same seed, the same tokens
    stop: str | Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    structured_outputs: Any = None  # StructuredOutputsParams | None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    extra_args: Mapping[str, Any] | None = None
    bad_words: Sequence[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: Sequence[int] | None = None
    flat_logprobs: bool = False
    watermarking: Any = None
    thinking_token_budget: int | None = None
    repetition_detection: Any = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: Sequence[int] | None = None
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            self.stop = ()
        elif isinstance(stop, str):
            self.stop = (stop,)
        elif isinstance(stop, Sequence) and not isinstance(stop, tuple):
            self.stop = tuple(stop)
        ids = self.stop_token_ids
        if ids is None:
            self.stop_token_ids = ()
        elif isinstance(ids, Sequence) and not isinstance(ids, (tuple, str)):
            self.stop_token_ids = tuple(ids)
        if self.top_k == -1:  # (vLLM's other "off")
            self.top_k = 0
        if isinstance(self.structured_outputs, Mapping):  # (its fields, as a server's request sends them)
            self.structured_outputs = StructuredOutputsParams.of(dict(self.structured_outputs))
        allowed = self.allowed_token_ids
        if isinstance(allowed, Sequence) and not isinstance(allowed, (tuple, str)):
            self.allowed_token_ids = tuple(allowed)
        problem = params_problem(self)
        if problem is not None:
            name = problem.split(" ", 1)[0]
            raise SamplingError(problem, parameter=name, value=getattr(self, name, None))

    def clone(self) -> SamplingParams:
        """A copy (what the engine keeps of a request, once checked: later changes to these params do not reach
        it; its mutable fields copied too)."""
        out = copy.copy(self)
        if self.logit_bias is not None:
            out.logit_bias = dict(self.logit_bias)
        return out

    @property
    def penalized(self) -> bool:
        """Does sampling need this request's ids (a penalty on)?"""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """A prompt's ``n`` sequences as requests of one sequence each, the i-th seeded ``seed + i`` (vLLM's rule).

    >>> [p.seed for p in fan_out(SamplingParams(n=3, seed=5))], fan_out(SamplingParams(n=2))[1].seed
    ([5, 6, 7], None)
    """
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)]


def params_problem(params: object) -> str | None:
    """What is wrong with ``params`` for the engine (a field it cannot sample with), or None: what building them
    refuses, and what the engine checks again when a request is added (they may have been set in place since).

    >>> p = SamplingParams()
    >>> p.seed = 2**70
    >>> params_problem(p)
    'seed must be an integer in [0, 2**63) or None, got 1180591620717411303424'
    """
    if not isinstance(params, SamplingParams):
        return f"sampling parameters must be SamplingParams, got {type(params).__name__}"
    p = params
    for name, off in NOT_SERVED.items():
        value = getattr(p, name)
        if (value is not off) if off is None else (type(value) is not type(off) or value != off):
            return f"{name} is not served by pagedkv (it must be {off!r}; docs/vllm-api.md)"
    checks = (
        (
            "max_tokens",
            p.max_tokens is None or (type(p.max_tokens) is int and 1 <= p.max_tokens < 1 << 63),
            "an integer in [1, 2**63) or None",
        ),
        (
            "temperature",
            isinstance(p.temperature, (int, float))
            and not isinstance(p.temperature, bool)
            and math.isfinite(p.temperature)
            and p.temperature >= 0,
            "a finite number >= 0",
        ),
        ("top_k", type(p.top_k) is int and 0 <= p.top_k < 1 << 31, "an integer in [0, 2**31)"),
        (
            "top_p",
            isinstance(p.top_p, (int, float)) and not isinstance(p.top_p, bool) and 0 < p.top_p <= 1,
            "a number in (0, 1]",
        ),
        ("seed", p.seed is None or (type(p.seed) is int and 0 <= p.seed < 1 << 63), "an integer in [0, 2**63) or None"),
        (
            "stop",
            isinstance(p.stop, tuple) and all(type(x) is str and x for x in p.stop),
            "a string or a sequence of non-empty strings",
        ),
        ("n", type(p.n) is int and 1 <= p.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
        ("repetition_penalty", _number(p.repetition_penalty) and p.repetition_penalty > 0, "a finite number > 0"),
        ("presence_penalty", _number(p.presence_penalty) and -2 <= p.presence_penalty <= 2, "a number in [-2, 2]"),
        ("frequency_penalty", _number(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2, "a number in [-2, 2]"),
        (
            "min_tokens",
            type(p.min_tokens) is int and 0 <= p.min_tokens <= (p.max_tokens if type(p.max_tokens) is int else 1 << 63),
            "an integer in [0, max_tokens]",
        ),
        ("min_p", _number(p.min_p) and 0 <= p.min_p <= 1, "a number in [0, 1]"),
        ("detokenize", type(p.detokenize) is bool, "true or false"),
        ("skip_special_tokens", type(p.skip_special_tokens) is bool, "true or false"),
        (
            "output_kind",
            p.output_kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY),
            "CUMULATIVE or FINAL_ONLY (pagedkv's LLM hands out finished requests)",
        ),
        (
            "truncate_prompt_tokens",
            p.truncate_prompt_tokens is None
            or (
                type(p.truncate_prompt_tokens) is int
                and p.truncate_prompt_tokens >= -1
                and p.truncate_prompt_tokens != 0
            ),
            "an integer >= 1, -1 or None",
        ),  # fmt: skip
        (
            "allowed_token_ids",
            p.allowed_token_ids is None
            or (
                isinstance(p.allowed_token_ids, tuple)
                and p.allowed_token_ids
                and all(type(t) is int and 0 <= t < 1 << 31 for t in p.allowed_token_ids)
            ),
            "a non-empty sequence of token ids or None",
        ),  # fmt: skip
        (
            "stream_interval",
            p.stream_interval is None or (type(p.stream_interval) is int and p.stream_interval >= 1),
            "an integer >= 1 or None",
        ),  # fmt: skip
        ("ignore_eos", type(p.ignore_eos) is bool, "true or false"),
        (
            "logprobs",
            p.logprobs is None or (type(p.logprobs) is int and 0 <= p.logprobs <= MAX_LOGPROBS),
            f"an integer in [0, {MAX_LOGPROBS}] or None",
        ),
        (
            "prompt_logprobs",
            p.prompt_logprobs is None or (type(p.prompt_logprobs) is int and 0 <= p.prompt_logprobs <= MAX_LOGPROBS),
            f"an integer in [0, {MAX_LOGPROBS}] or None",
        ),
        (
            "stop_token_ids",
            isinstance(p.stop_token_ids, tuple) and all(type(t) is int and 0 <= t < 1 << 31 for t in p.stop_token_ids),
            "a sequence of token ids",
        ),
        ("include_stop_str_in_output", type(p.include_stop_str_in_output) is bool, "true or false"),
        (
            "logit_bias",
            p.logit_bias is None
            or (
                isinstance(p.logit_bias, Mapping)
                and all(type(t) is int and 0 <= t < 1 << 31 for t in p.logit_bias)
                and all(_number(b) and -100 <= b <= 100 for b in p.logit_bias.values())
            ),
            "a mapping of token ids to numbers in [-100, 100]",
        ),
    )
    for name, ok, what in checks:
        if not ok:
            return f"{name} must be {what}, got {shown(getattr(p, name)):.60}"
    if p.structured_outputs is not None:
        if not isinstance(p.structured_outputs, StructuredOutputsParams):
            return (
                f"structured_outputs must be StructuredOutputsParams or None, got {type(p.structured_outputs).__name__}"
            )
    return None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def request_seed(request_id: object, params: SamplingParams) -> int:
    """The request's seed: its own, or one drawn from its id (the same id, the same draws, in any process).

    >>> request_seed("a", SamplingParams(seed=7)), request_seed("a", SamplingParams()) == request_seed("a", SamplingParams())
    (7, True)
    """
    return params.seed if params.seed is not None else zlib.crc32(str(request_id).encode())


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) in int64 arithmetic; multipliers stay below
    2**31, so no product of 32-bit values overflows."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & _M32
    x = ((x ^ (x >> 13)) * 0x27D4EB2F) & _M32
    return x ^ (x >> 16)


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 exponential variates, a function of (seed, counter, token id) only.

    >>> e = race_noise(torch.tensor([1, 1]), torch.tensor([0, 0]), 5)
    >>> bool(torch.equal(e[0], e[1])) and bool((e > 0).all())
    True
    """
    key = _mix(_mix(seeds.to(torch.int64) & _M32) ^ (counters.to(torch.int64) & _M32))
    ids = _mix(torch.arange(vocab, dtype=torch.int64, device=seeds.device) * 0x9E3779B1)
    bits = _mix(key[:, None] ^ ids[None, :]) >> 8  # 24 uniform bits
    # (the largest rounds to 1.0 in float32, whose variate would be 0: held at the next one up, 2**-25, for a
    # token out of reach (p 0: masked, past top-k or top-p) must lose the race, and 0 / 0 would win it as NaN)
    return (-torch.log((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24)))).clamp_min(2.0**-25)


@dataclass(frozen=True, slots=True)
class History:
    """What sampling needs of the rows beyond their logits, where a request asks it: each row's prompt and output
    ids (``ids``; None for a row without penalties), the model's stop ids (``min_tokens`` holds them back), and
    ids still on the device (overlapped scheduling: ``pending`` rows' last output id is ``pending_ids[at]``)."""

    ids: Sequence[tuple[Sequence[int], Sequence[int]] | None] = ()
    stop_ids: frozenset[int] = frozenset()
    pending: Sequence[tuple[int, int]] = ()  # (row, index into pending_ids)
    pending_ids: torch.Tensor | None = None


NO_HISTORY = History()


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    counters: Sequence[int],
    history: History = NO_HISTORY,
) -> torch.Tensor:
    """Every row's token at once, on ``logits``' device: (rows,) int64. Row ``i`` samples with ``params[i]``,
    drawing the race noise of (``seeds[i]``, ``counters[i]``: the tokens its request drew before), after its
    penalties and ``min_tokens`` (``history``). No host sync."""
    logits = _held_back(
        _penalized(_allowed(_biased(logits, params), params), params, history), params, counters, history.stop_ids
    )
    out = torch.argmax(logits, dim=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return out
    dev = logits.device
    ps = [params[i] for i in drawn]
    rows = to_device(drawn, torch.int64, dev)
    temps = to_device([p.temperature for p in ps], torch.float32, dev)
    probs = torch.softmax(logits[rows].float() / temps[:, None], dim=-1)
    if any(p.min_p > 0 for p in ps):  # (vLLM's min_p: ids less likely than min_p times the likeliest dropped)
        floor = to_device([p.min_p for p in ps], torch.float32, dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    noise = race_noise(
        to_device([seeds[i] for i in drawn], torch.int64, dev),
        to_device([counters[i] for i in drawn], torch.int64, dev),
        probs.shape[1],
    )
    if any(p.top_k > 0 or p.top_p < 1.0 for p in ps):
        vocab = probs.shape[1]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], torch.int64, dev)
        kth = sorted_p.gather(1, (k - 1)[:, None])
        sorted_p = torch.where(sorted_p >= kth, sorted_p, torch.zeros_like(sorted_p))  # ties with the k-th stay
        top_p = to_device([p.top_p for p in ps], torch.float32, dev)[:, None]
        keep = (torch.cumsum(sorted_p, 1) - sorted_p < top_p * sorted_p.sum(1, keepdim=True)) | (top_p >= 1.0)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        best = torch.argmax(sorted_p / noise.gather(1, order), dim=1)
        chosen = order.gather(1, best[:, None])[:, 0]
    else:
        chosen = torch.argmax(probs / noise, dim=1)
    return out.index_copy(0, rows, chosen)


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added (float32 then; the rows without one as they are; an id past
    the vocabulary is none of its logits)."""
    vocab = logits.shape[1]
    where = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items() if t < vocab]
    if not where:
        return logits
    dev = logits.device
    out = logits.float().clone()
    rows, ids, bias = zip(*where)
    out.index_put_(
        (to_device(list(rows), torch.int64, dev), to_device(list(ids), torch.int64, dev)),
        to_device(list(bias), torch.float32, dev),
        accumulate=True,
    )
    return out


def _allowed(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with every id outside a row's ``allowed_token_ids`` out of reach (the rows without them as they
    are)."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
    for k, i in enumerate(rows):
        ids = [t for t in params[i].allowed_token_ids or () if t < vocab]
        keep[k, to_device(ids, torch.int64, dev)] = True
    out = logits.clone()
    where = to_device(rows, torch.int64, dev)
    out[where] = torch.where(keep, out[where], torch.full_like(out[where], float("-inf")))
    return out


def _penalized(logits: torch.Tensor, params: Sequence[SamplingParams], history: History) -> torch.Tensor:
    """``logits`` with vLLM's penalties applied to the rows that ask them (float32 then; the others as they are)."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    ps = [params[i] for i in rows]
    ids = [history.ids[i] or ((), ()) for i in rows]
    counts = _counts([out for _, out in ids], vocab, dev)  # (rows, vocab): each id's occurrences in the output
    pending = [(rows.index(r), at) for r, at in history.pending if r in rows]
    if pending and history.pending_ids is not None:  # (a last id still on the device counts too)
        where = to_device([k for k, _ in pending], torch.int64, dev)
        counts.index_put_(
            (where, history.pending_ids[to_device([at for _, at in pending], torch.int64, dev)]),
            torch.ones(len(pending), device=dev),
            accumulate=True,
        )
    sub = logits[to_device(rows, torch.int64, dev)].float()
    seen = counts > 0
    if any(p.repetition_penalty != 1.0 for p in ps):
        anywhere = seen | (_counts([prompt for prompt, _ in ids], vocab, dev) > 0)
        rp = to_device([p.repetition_penalty for p in ps], torch.float32, dev)[:, None]
        sub = torch.where(anywhere, torch.where(sub > 0, sub / rp, sub * rp), sub)
    freq = to_device([p.frequency_penalty for p in ps], torch.float32, dev)[:, None]
    pres = to_device([p.presence_penalty for p in ps], torch.float32, dev)[:, None]
    sub = sub - freq * counts - pres * seen.float()
    out = logits.float().clone()
    out[to_device(rows, torch.int64, dev)] = sub
    return out


def _counts(id_lists: Sequence[Sequence[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """(len(id_lists), vocab) float32: how often each id occurs in each list (one padded copy, one scatter)."""
    width = max((len(x) for x in id_lists), default=0)
    counts = torch.zeros(len(id_lists), vocab + 1, device=dev)  # (a last column takes the padding)
    if width:
        padded = to_device([[*x, *[vocab] * (width - len(x))] for x in id_lists], torch.int64, dev)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=dev))
    return counts[:, :vocab]


def _held_back(
    logits: torch.Tensor, params: Sequence[SamplingParams], counters: Sequence[int], stop_ids: frozenset[int]
) -> torch.Tensor:
    """The stop ids (the model's and the row's own ``stop_token_ids``) out of reach of every row still short of its
    ``min_tokens``."""
    rows = [i for i, (p, c) in enumerate(zip(params, counters)) if c < p.min_tokens]
    if not rows:
        return logits
    vocab = logits.shape[1]
    ban = [(i, s) for i in rows for s in sorted(stop_ids.union(params[i].stop_token_ids or ())) if s < vocab]
    if not ban:
        return logits
    dev = logits.device
    out = logits.clone()
    out[to_device([i for i, _ in ban], torch.int64, dev), to_device([s for _, s in ban], torch.int64, dev)] = float(
        "-inf"
    )
    return out


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """(rows, 2 + 2 * max(ks)) float64 on ``logits``' device, for each row: the logprob of its token ``ids[i]``
    (log-softmax of the model's logits, vLLM's raw logprobs), its rank (1 + the ids more likely), then the ``k``
    most likely ids and their logprobs (a row asking fewer: padded). One copy reads it (``Logprob.rows``)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, ids[:, None])
    rank = (lp > chosen).sum(1, keepdim=True) + 1
    k = max(ks, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
    return torch.cat([chosen.double(), rank.double(), top_ids.double(), top_lp.double()], dim=1)


@dataclass(frozen=True, slots=True)
class Logprob:
    """A token's logprob, as vLLM gives it: ``logprob``, its ``rank`` among the ids (1: the most likely), and the
    ``decoded_token`` (its text)."""

    logprob: float
    rank: int
    decoded_token: str | None = None

    @staticmethod
    def rows(values: Sequence[float], token: int, k: int, decode: Any) -> dict[int, Logprob]:
        """One ``token_logprobs`` row as vLLM's per-token dict: the token's own entry and the ``k`` most likely."""
        width = (len(values) - 2) // 2
        out = {token: Logprob(values[0], int(values[1]), decode([token]))}
        for j in range(k):
            tid = int(values[2 + j])
            out.setdefault(tid, Logprob(values[2 + width + j], j + 1, decode([tid])))
        return out


def cut_at_stop(text: str, stop: tuple[str, ...], start: int = 0, keep: bool = False) -> str:
    """``text`` up to the first of the request's stop strings that it holds from ``start`` on (each checked in
    order; before ``start``: what came before ``min_tokens``, exempt); ``keep``: through it
    (``include_stop_str_in_output``).

    >>> cut_at_stop("a. b. c.", (".",)), cut_at_stop("a. b. c.", (".",), 2), cut_at_stop("a. b.", (".",), keep=True)
    ('a', 'a. b', 'a.')
    """
    for s in stop:
        at = text.find(s, start)
        if at >= 0:
            text = text[: at + len(s) if keep else at]
    return text
