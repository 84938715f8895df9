"""The scheduler's records: its config, what it keeps of a request, its state and its plans."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from immutables import Map
from pyrsistent import PDeque, pdeque

from pagedkv.core.config import CacheConfig, InvalidConfig
from pagedkv.core.errors import KVError, RequestId, is_int, shown
from pagedkv.core.outputs.events import KVEvent
from pagedkv.core.outputs.metadata import KVMetadata
from pagedkv.core.scheduler.lifecycle import FinishReason, Stage
from pagedkv.core.scheduler.tokens import TokenLog
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.store.state import KVState, initial_state


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 8192  # query tokens per step
    chunked_prefill: bool = True
    watermark_blocks: int = 0  # free blocks an admission leaves for decode growth
    allow_overtaking: bool = False  # may a later request be admitted past one that waits for blocks?
    # blocks for a prompt as its chunks are planned (vLLM's way), not all at admission: a window group then
    # holds its window and a chunk, never the whole prompt; a chunk that cannot grow preempts the newest
    grow_prefill: bool = False
    # vLLM's: the most prompt tokens one request's chunk takes in a step (0: no cap but the budget; chunked prefill
    # only). A long prompt then runs in chunks a captured graph holds (the engine's default on a GPU)
    long_prefill_token_threshold: int = 0

    @property
    def chunk_cap(self) -> int:
        """The most prompt tokens one request's chunk takes in a step besides the budget (``1 << 62``: no cap)."""
        return self.long_prefill_token_threshold or 1 << 62

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                raise InvalidConfig(f"{key} must be a positive integer, got {shown(getattr(self, key))}")
        t = self.long_prefill_token_threshold
        if not is_int(t) or t < 0:
            raise InvalidConfig(f"long_prefill_token_threshold must be a non-negative integer, got {shown(t)}")
        if not is_int(self.watermark_blocks) or self.watermark_blocks < 0:
            raise InvalidConfig(f"watermark_blocks must be a non-negative integer, got {shown(self.watermark_blocks)}")
        for key in ("chunked_prefill", "allow_overtaking", "grow_prefill"):
            if type(getattr(self, key)) is not bool:
                raise InvalidConfig(f"{key} must be a boolean")


@dataclass(frozen=True, slots=True)
class SeqRequest:
    """What the scheduler keeps of a request.

    An LLM request has a ``prompt`` and grows ``output``; a diffusion request has
    ``rows`` (one per CFG branch) and ``steps`` denoising steps.
    """

    request_id: RequestId
    prompt: tuple[int, ...] = ()
    max_tokens: int = 16
    rows: tuple[RowSpec, ...] | None = None
    steps: int = 1
    extra_keys: tuple[str, ...] = ()
    output: tuple[int, ...] = ()
    arrival: int = 0
    # the chain hashes of the prompt's full blocks, computed once at ``submit`` (with prefix caching): every
    # admission and commit of the request takes them (``RequestSpec.block_hashes``) instead of hashing again
    block_hashes: tuple[bytes, ...] = ()
    # the prefix-cache hit is at most this many tokens (``RequestSpec.max_hit``; 0: the cache is not read, as a
    # request scoring its prompt needs every position computed); None: no bound but the cache's
    max_hit: int | None = None

    @property
    def is_diffusion(self) -> bool:
        return self.rows is not None

    def spec(self) -> RequestSpec:
        """What admission sees: for an LLM request its prompt and every token it generated (the prompt's block
        hashes given)."""
        if self.rows is not None:
            return RequestSpec(self.request_id, self.rows, self.extra_keys)
        tokens = self.prompt + self.output if self.output else self.prompt  # (the same tuple while no output)
        return RequestSpec(
            self.request_id,
            (RowSpec.of_tokens(tokens),),
            self.extra_keys,
            max_hit=self.max_hit,
            block_hashes=self.block_hashes,
        )


@dataclass(frozen=True, slots=True)
class DiffusionRun:
    """A whole diffusion request in one plan entry: ``steps`` forwards, the first
    with ``first`` (phase prefill), the others with ``later`` (phase denoise)."""

    request_id: RequestId
    steps: int
    first: KVMetadata
    later: KVMetadata | None

    @property
    def phases(self) -> tuple[str, ...]:
        return ("prefill",) + ("denoise",) * (self.steps - 1)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int
    decode: tuple[RequestId, ...]
    prefill: tuple[tuple[RequestId, int], ...]  # (request, query tokens this step)
    diffusion: tuple[DiffusionRun, ...]
    preempted: tuple[RequestId, ...]
    finished: tuple[tuple[RequestId, FinishReason], ...]  # ended by schedule itself (a permanent refusal)
    metadata: tuple[KVMetadata, ...]  # the LLM forward: prefill rows' snapshot, then decode rows' (all in the first
    # when rows verify drafts: one forward)
    samples: tuple[RequestId, ...] = ()  # requests whose forward yields a token: on_output wants it
    refusals: tuple[KVError, ...] = ()  # why each of ``finished`` ended: the refusal that happened, its numbers
    # decodes with draft tokens to verify (speculative decoding): each row computes its last sampled token and
    # the drafts (the prefill snapshot holds their rows), and yields 1 to len(drafts) + 1 tokens
    verify: tuple[tuple[RequestId, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        return (
            len(self.decode)
            + sum(q for _, q in self.prefill)
            + sum(r.first.num_query_tokens for r in self.diffusion)
            + sum(1 + len(d) for _, d in self.verify)
        )

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.prefill or self.diffusion or self.verify)


class Prefilled(NamedTuple):
    """A prefill chunk of the last plan."""

    request_id: RequestId
    query_tokens: int
    target: int  # the computed count after it
    samples: bool  # its last chunk: the forward yields a token


@dataclass(frozen=True, slots=True)
class SchedState:
    """The scheduler's state, a value like the core's.

    Each live request has one ``Stage`` in ``stages`` (the lifecycle table says how it moves);
    ``waiting`` and ``running`` give the orders (arrival; admission, the newest last). Shaped for
    the common step (every running request decodes one token): what a request is (prompt,
    limits) sits in ``seqs`` and never changes while it runs; what it generated sits in ``log``
    (bytes by slot); the last plan is kept as its decode batch, its prefill chunks, its
    diffusion runs and its decodes with drafts to verify.
    """

    config: SchedulerConfig
    kv: KVState
    waiting: PDeque[RequestId]
    running: tuple[RequestId, ...]  # in admission order: the newest is last
    stages: Map[RequestId, Stage]  # every live request's phase
    seqs: Map[RequestId, SeqRequest]  # live requests, as submitted (output empty)
    log: TokenLog  # live requests: the ids each generated so far (an ended request leaves every record: the
    # plan or output that ended it said how, and the state holds live requests only, never the run's history)
    sched_decode: tuple[RequestId, ...]  # the last plan, until its on_output: its decodes,
    sched_prefill: tuple[Prefilled, ...]  # its prefill chunks,
    sched_diffusion: tuple[RequestId, ...]  # and its diffusion runs
    step: int
    arrivals: int
    # the core's KV events of the transition that made this state (schedule, on_output, cancel), in order;
    # for an engine to publish (pagedkv.integrations.vllm); not part of the state's value or digest
    kv_events: tuple[KVEvent, ...] = field(default=(), compare=False)
    sched_verify: tuple[tuple[RequestId, tuple[int, ...]], ...] = ()  # the last plan's decodes with drafts
    # requests whose last token's id is not known yet (an output given ahead of its ids: ``on_tokens`` fills it)
    awaiting: frozenset[RequestId] = frozenset()

    @property
    def live(self) -> LiveRequests:
        """Waiting and running requests by id, each with what it has generated (``output``)."""
        return LiveRequests(self.seqs, self.log)

    @property
    def prefilling(self) -> frozenset[RequestId]:
        """Running requests whose prompt is not computed yet."""
        return frozenset(rid for rid, phase in self.stages.items() if phase is Stage.PREFILLING)

    @property
    def pending_output(self) -> bool:
        """Has the last plan not had its on_output yet?"""
        return bool(self.sched_decode or self.sched_prefill or self.sched_diffusion or self.sched_verify)


class LiveRequests(Mapping[RequestId, SeqRequest]):
    """``SchedState.live``: a read-only view that puts each request's output back in its record."""

    __slots__ = ("seqs", "log")

    def __init__(self, seqs: Map[RequestId, SeqRequest], log: TokenLog) -> None:
        self.seqs = seqs
        self.log = log

    def __getitem__(self, rid: RequestId) -> SeqRequest:
        seq = self.seqs[rid]
        return SeqRequest(
            seq.request_id,
            seq.prompt,
            seq.max_tokens,
            seq.rows,
            seq.steps,
            seq.extra_keys,
            self.log.tokens(rid),
            seq.arrival,
        )

    def __contains__(self, rid: object) -> bool:
        try:
            return rid in self.seqs
        except TypeError:
            return False

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


def new_scheduler(cache: CacheConfig, config: SchedulerConfig = SchedulerConfig()) -> SchedState:
    return SchedState(config, initial_state(cache), pdeque(), (), Map(), Map(), TokenLog.empty(), (), (), (), 0, 0)


def query_ids(rows: Sequence[Any], state: SchedState, verify: Mapping[RequestId, tuple[int, ...]] | None) -> list[int]:
    """The ids at a varlen forward's query positions (``RowMetadata`` rows of the scheduler ``state``): each
    request's prompt, then what it generated, then the drafts it verifies."""
    ids: list[int] = []
    seqs, log = state.seqs, state.log
    for row in rows:
        rid = row.request_id
        prompt = seqs[rid].prompt
        start, end, p = row.kv_start_pos, row.seq_len, len(prompt)
        ids.extend(prompt[start:end])
        if end > p:
            known = p + log.count(rid)
            ids.extend(log.ids(rid, max(start - p, 0), min(end, known) - p))
            ids.extend(verify[rid][: end - known] if verify and end > known else ())
    return ids
