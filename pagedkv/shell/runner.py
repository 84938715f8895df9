"""The model runner: what a step does on the device, between the scheduler's plan and its output.

A step's three calls are the engine's (shell/engine.py): ``schedule`` (the core's plan), ``ModelRunner.run``
(this module: each snapshot installed in the worker, each forward queued, the sampled rows' ids drawn) and the
output (the engine: the ids taken by their requests, ``on_output``). The runner owns the rank's forward state:
the captured graphs, the last step's ids on the device (the next decode's input), the prompt positions a
forward scores. It decides how a forward is laid out (``_token_rows``: one query token a row, replayed from a
graph, or as the model's own forward), how a prefill forward is cut for the graphs (``graph_pieces``) and
whether the step's decode rows ride in a prompt's forward (``ride_along``). Nothing here waits for the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.errors import RequestId
from pagedkv.core.outputs.metadata import DecodeRows, KVMetadata, Phase, RowMetadata
from pagedkv.core.scheduler import SchedState, StepPlan, query_ids
from pagedkv.shell.graphs import GRAPH_ROWS, GraphDecoder, buckets_for, launches_outweigh
from pagedkv.shell.install_rules import one_causal_segment
from pagedkv.shell.outcomes import Live
from pagedkv.shell.overlap import Overlap
from pagedkv.shell.rank import Rank
from pagedkv.shell.sampling import NO_HISTORY, History, Logprob, sample_batch, token_logprobs
from pagedkv.shell.speculative import Speculation
from pagedkv.shell.structured import Constrained, Grammars
from pagedkv.shell.transfer import to_device

FLAT_READS = 1 << 20  # keys a prefill forward laid out one token a row may read in all (ModelRunner._token_rows)

__all__ = ["ModelRunner", "flat_reads", "graph_pieces", "ride_along"]


def graph_pieces(meta: KVMetadata, most: int) -> list[KVMetadata]:
    """A prefill forward as the engine runs it with graphs whose largest bucket holds ``most`` token rows: itself;
    or, where several requests' tokens are over ``most`` though each request's chunk is not (nor its reads over
    ``FLAT_READS``), consecutive pieces cut between requests, each within ``most`` tokens and ``FLAT_READS`` reads,
    each then replayed one token a row (``ModelRunner._token_rows``). A row's sums are its own whatever rows share its
    forward (docs/gpu.md), so the tokens are those of one forward; a step that takes in several prompts at once is
    then not launched layer by layer (bench/gpu_serve.py's mix: its slowest steps, forwards of 555-1,375 prompt
    tokens of several requests, ran eagerly at 60-73 ms on an H200)."""
    if len(meta.rows) < 2 or meta.num_query_tokens <= most:
        return [meta]
    pieces, start, tokens, reads = [], 0, 0, 0
    for i, r in enumerate(meta.rows):
        q, cost = r.query_len, r.query_len * r.seq_len
        if q > most or cost > FLAT_READS or not one_causal_segment(r):
            return [meta]  # (a row no bucket takes: the forward runs whole, eagerly)
        if tokens + q > most or reads + cost > FLAT_READS:
            pieces.append(replace(meta, rows=tuple(meta.rows[start:i])))
            start, tokens, reads = i, 0, 0
        tokens, reads = tokens + q, reads + cost
    pieces.append(replace(meta, rows=tuple(meta.rows[start:])))
    return pieces


def flat_reads(rows: Sequence[RowMetadata]) -> int | None:
    """The keys ``rows`` read laid out one query token a row (each token row reads its whole prefix); None where a
    row is not one causal segment (it cannot be so laid out)."""
    if isinstance(rows, DecodeRows):
        return sum(rows.seq_lens)
    reads = 0
    for r in rows:
        if not one_causal_segment(r):
            return None
        reads += r.query_len * r.seq_len
    return reads


def ride_along(forwards: list[KVMetadata], most: int, eager: int = 0) -> list[tuple[KVMetadata, KVMetadata | None]]:
    """A step's forwards (``graph_pieces``), each with the decode snapshot riding in it: the step's decode rows moved
    into its first prefill forward that holds them too (every row one causal segment), leading its rows, each a row
    of one query token (what a prefill of that one position computes). A forward laid out a token a row holds them
    within ``most`` token rows and ``FLAT_READS`` reads: the step then replays one graph instead of one for the
    decodes and one for the prompts' chunk (bench/gpu_serve.py's mix on an H200, a step that took in a prompt
    replayed two or three graphs, 9-17 ms against 4.6 for a decode step, the inter-token latency's p99). A forward
    that runs eagerly whatever rides in it (over ``most`` tokens or the reads) holds them within ``eager`` tokens
    (0: none): the step then reads the model's weights once instead of twice, the decode graph's replay gone (Llama-8B
    on an H100 under arrivals: a step that took in a prompt replayed the decodes' graph, ~6.7 ms, beside the
    prompt's eager forward). Nothing rides where nothing holds the decodes: the forwards as they were, each with
    ``None``. (A decode row is one query token by its phase, and every one causal.)

    >>> from pagedkv.core.outputs.metadata import DecodeRows, RowMetadata, Segment
    >>> from array import array
    >>> d = KVMetadata(3, 0, 16, Phase.DECODE, DecodeRows(("a",), ((1,),), array("q", [5]), array("q", [20])))
    >>> p = KVMetadata(3, 0, 16, Phase.PREFILL, (RowMetadata("b", 0, ((2,),), 4, 4, 0, (32, 33, 34, 35),
    ...                                                     (Segment(True, 0, 4, 4),)),))
    >>> [(f.phase.value, [r.request_id for r in f.rows], lead is d) for f, lead in ride_along([d, p], 512)]
    [('prefill', ['a', 'b'], True)]
    >>> [(f.phase.value, lead) for f, lead in ride_along([d, p], 4)]  # (5 rows: over the bucket)
    [('decode', None), ('prefill', None)]
    >>> [(f.phase.value, lead is d) for f, lead in ride_along([d, p], 3, eager=8)]  # (p runs eagerly anyway)
    [('prefill', True)]
    """
    alone: list[tuple[KVMetadata, KVMetadata | None]] = [(f, None) for f in forwards]
    decodes = [k for k, f in enumerate(forwards) if f.phase is Phase.DECODE]
    d = forwards[decodes[0]] if len(forwards) > 1 and len(decodes) == 1 else None
    reads = None if d is None else flat_reads(d.rows)
    if d is None or reads is None:
        return alone
    for k, f in enumerate(forwards):
        if f.phase is not Phase.PREFILL or (f.generation, f.epoch) != (d.generation, d.epoch):
            continue
        own = flat_reads(f.rows)
        if own is None:
            continue
        tokens = f.num_query_tokens + len(d.rows)
        flat = tokens <= most and reads + own <= FLAT_READS
        eagerly = (f.num_query_tokens > most or own > FLAT_READS) and tokens <= eager
        if not (flat or eagerly):
            continue
        merged = replace(f, rows=(*d.rows, *f.rows))
        return [((merged, d) if j == k else (g, None)) for j, g in enumerate(forwards) if j != decodes[0]]
    return alone


class ModelRunner:
    """One rank's forwards and sampling over ``model`` (``forward(tokens, batch, pool, backend, layout[,
    logits_at])``) and its KV side ``rank``: ``run`` a plan, its ids and logprob rows on the device.

    ``requests``: the engine's live requests (read: their ids, params and prompts), the same dict the engine
    keeps. ``graphs``: capture the decode graphs over the worker's buffers now, up to ``graph_rows`` rows.
    ``overlapped``: the engine reads a step's ids a step late (the last step's ids are the next decode's input
    on the device). ``batch_invariant``: every prefill forward laid out one query token a row.

    How a prefill forward is laid out, two decisions held as attributes (benches set them for A/B runs):
    ``flat_tokens``, the most query tokens a forward laid out one a row and replayed takes (a replay's tokens at
    every model size: under arrivals at Llama-8B's shapes on an H100, TTFT p50 42.6 ms with forwards of 34 tokens
    or fewer replayed, 18.4 with those of 512, bench/gpu_arrivals.py); ``pieces``, whether a forward over a
    replay's tokens is cut into replays between requests (``graph_pieces``: only a model whose launches outweigh a
    replay's matrix work, ``graphs.launches_outweigh``; a larger one pays every piece's read of its weights where
    a long step's eager launches hide behind its products)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        rank: Rank,
        backend: Any,
        requests: dict[RequestId, Live],
        *,
        graphs: bool,
        graph_rows: int,
        overlapped: bool,
        batch_invariant: bool,
    ) -> None:
        self.model, self.tokenizer, self.backend, self.requests = model, tokenizer, backend, requests
        self.pool, self.worker, self.layout = rank.pool, rank.worker, rank.layout
        self.overlapped, self.batch_invariant = overlapped, batch_invariant
        self.last: tuple[tuple[RequestId, ...], torch.Tensor] | None = None  # the last step's samples, on the device
        self._scoring: list[tuple[Live, int, int]] = []  # this step's prompt positions to score: (its request, the
        # prompt token its logits score, its row among the step's logits)
        self.scorers: set[RequestId] = set()  # requests asking prompt logprobs whose prompt is not scored yet
        self.graphs: GraphDecoder | None = None
        if graphs:
            rows = max(graph_rows, min(rank.worker.token_rows, GRAPH_ROWS))  # (verify steps' token rows too)
            self.graphs = GraphDecoder(model, rank, backend, buckets=buckets_for(rows))
            self.graphs.capture()  # at start-up: every bucket, over the worker's persistent buffers
        # the most token rows one replay takes (0 without graphs)
        decoder = self.graphs
        self.replay_rows = (
            0 if decoder is None or not decoder.buckets else min(decoder.buckets[-1], rank.worker.token_rows)
        )
        self.flat_tokens = rank.worker.token_rows if batch_invariant else self.replay_rows  # (``_token_rows``)
        self.pieces = launches_outweigh(model, self.replay_rows, overlapped)  # (``_pieces``)

    def run(
        self, plan: StepPlan, bound: list[Live], state: SchedState, grammars: Grammars | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each of the plan's forwards (``_forward``) and a sample of every row the plan samples (``bound``: their
        requests): the ids, on the device, in ``plan.samples``' order (a row verifying drafts: one a position),
        and their logprob rows where a request asks them (``sampling.token_logprobs``). ``state``: the scheduler's
        after ``plan``; ``grammars``: the engine's compiler where a request was constrained. Nothing waits for the
        device."""
        outs: list[torch.Tensor] = []
        where: dict[RequestId, int] = {}  # each sampled request's first logits row
        verify, samples = dict(plan.verify), plan.samples
        self._scoring = []
        forwards = [piece for meta in plan.metadata for piece in self._pieces(meta, bool(verify))]
        flat, eager = self.flat_tokens, 0 if self.batch_invariant else self.worker.max_tokens
        riding = ride_along(forwards, flat, eager) if not verify else [(f, None) for f in forwards]
        for k, (meta, lead) in enumerate(riding):
            out = self._forward(meta, state, verify, where, sum(len(o) for o in outs), lead)
            # (a replay's logits live in its graph's buffer, which a later forward of the step may replay again)
            outs.append(out.clone() if k + 1 < len(riding) and self.graphs is not None else out)
        logits = None if not outs else outs[0] if len(outs) == 1 else torch.cat(outs)
        if self._scoring and logits is not None:
            self._score_prompts(logits)
        if not samples or logits is None:  # no forward, or every row mid-way through its prompt: nothing to sample
            return None, None
        if verify:  # (a row verifying drafts: each position's logits row, request and counter)
            pick, live, counters = Speculation.positions(samples, verify, where, dict(zip(samples, bound)))
        else:
            pick, live, ahead = [where[rid] for rid in samples], bound, state.awaiting
            counters = [
                len(x.completion.token_ids) + (rid in ahead) for rid, x in zip(samples, live)
            ]  # (in flight: drawn)
        if pick != list(range(len(logits))):
            logits = logits[to_device(pick, torch.int64, logits.device)]
        params = [x.params for x in live]
        if grammars is not None:  # (structured outputs: the ids each grammar allows, before the rest of the sampling)
            constrained = self._constrained(samples, verify, bound)
            if constrained:
                logits = grammars.masked(logits, constrained)
        history = (
            self._history(samples, verify, live, state.awaiting)
            if any(p.penalized or p.min_tokens for p in params)
            else NO_HISTORY
        )
        ids = sample_batch(logits, params, [x.seed for x in live], counters, history)
        ks = [p.logprobs for p in params]
        lps = None if all(k is None for k in ks) else token_logprobs(logits, ids, [k or 0 for k in ks])
        self.last = None if verify else (samples, ids)  # (a verify's ids are not one a row)
        return ids, lps

    @staticmethod
    def _constrained(
        samples: Sequence[RequestId], verify: dict[RequestId, tuple[int, ...]], bound: list[Live]
    ) -> list[tuple[int, Constrained, tuple[int, ...]]]:
        """The constrained requests among the sampled: (their first row among the sampled logits, their matcher,
        the drafts they verify: a row a position)."""
        out, row = [], 0
        for rid, x in zip(samples, bound):
            drafts = verify.get(rid, ())
            c = x.constraint
            if c is not None and not c.ended:
                out.append((row, c, drafts))
            row += 1 + len(drafts)
        return out

    def _score_prompts(self, logits: torch.Tensor) -> None:
        """The prompt tokens this step's forwards scored (``_scoring``), their logprobs and the k most likely ids'
        onto their completions' ``prompt_logprobs`` (one read of the device: a step carrying such a prompt waits
        for its forward)."""
        scoring, self._scoring = self._scoring, []
        rows = to_device([at for _, _, at in scoring], torch.int64, logits.device)
        tokens = to_device([tok for _, tok, _ in scoring], torch.int64, logits.device)
        ks = [x.params.prompt_logprobs or 0 for x, _, _ in scoring]
        values = token_logprobs(logits[rows], tokens, ks).tolist()
        for (live, tok, _), k, row in zip(scoring, ks, values):
            lps = live.completion.prompt_logprobs
            if lps is not None:
                lps.append(Logprob.rows(row, tok, k, self.tokenizer.decode))
                if len(lps) >= len(live.completion.prompt_token_ids):  # (its whole prompt scored)
                    self.scorers.discard(live.completion.request_id)

    def _scored(self, meta: KVMetadata, at: list[int] | None, base: int) -> list[int] | None:
        """``at`` (the forward's logits rows: None, each row's last token) with the positions appended whose logits
        score a prompt token of a request asking ``prompt_logprobs`` and not scored yet (position p scores token
        p + 1; a preempted request's recompute scores none again), each noted in ``_scoring``; ``at`` itself where
        no row asks."""
        requests = self.requests
        self.scorers = {rid for rid in self.scorers if rid in requests}  # (an ended one scores nothing more)
        extra: list[tuple[Live, int, int]] = []
        start = 0
        for r in meta.rows:
            live = self.requests.get(r.request_id)
            lps = None if live is None else live.completion.prompt_logprobs
            if live is not None and lps is not None:
                prompt = live.completion.prompt_token_ids
                lo = max(r.kv_start_pos, len(lps) - 1)
                hi = min(r.kv_start_pos + r.query_len, len(prompt) - 1)
                extra += [(live, prompt[p + 1], start + p - r.kv_start_pos) for p in range(lo, hi)]
            start += r.query_len
        if not extra:
            return at
        if at is None:
            at = [end - 1 for end in itertools.accumulate(r.query_len for r in meta.rows)]
        first = base + len(at)
        self._scoring += [(live, tok, first + i) for i, (live, tok, _) in enumerate(extra)]
        return at + [pos for _, _, pos in extra]

    def _history(
        self,
        samples: Sequence[RequestId],
        verify: dict[RequestId, tuple[int, ...]],
        live: list[Live],
        awaiting: Collection[RequestId],
    ) -> History:
        """What penalties and ``min_tokens`` read of each sampled row (``live``: one a logits row): its prompt and
        output ids (a verify row's position j: its output and the first j drafts), the model's stop ids, and the
        rows whose last output id is still on the device (``awaiting``, overlapped: the last step's, ``last``)."""
        ids: list[tuple[Sequence[int], Sequence[int]] | None] = []
        for rid in samples:
            comp = self.requests[rid].completion
            draft = verify.get(rid, ())
            for j in range(1 + len(draft)):
                p = live[len(ids)].params
                ids.append((comp.prompt_token_ids, [*comp.token_ids, *draft[:j]]) if p.penalized else None)
        last = self.last
        if not self.overlapped or last is None or not awaiting:
            return History(ids, self.tokenizer.stop_token_ids)
        where = {rid: i for i, rid in enumerate(last[0])}
        pending = [(k, where[rid]) for k, rid in enumerate(samples) if rid in awaiting and rid in where]
        return History(ids, self.tokenizer.stop_token_ids, pending, last[1])

    def _forward(
        self,
        meta: KVMetadata,
        state: SchedState,
        verify: dict[RequestId, tuple[int, ...]],
        where: dict[RequestId, int],
        base: int,
        lead: KVMetadata | None = None,
    ) -> torch.Tensor:
        """One snapshot's forward queued: its logits, each request's first logits row in ``where`` (after ``base``).
        Decodes replay a graph where captured; a verify step, and a prefill forward a graph holds, go one query token
        a row (``_token_rows``: the decode kernel and its graphs compute each position as a decode of it would).
        ``lead``: the decode snapshot whose rows lead ``meta``'s (``ride_along``; their ids as its own would be)."""
        verifying = bool(verify) and meta.phase is Phase.PREFILL  # (the engine's rows are causal: the worker checks)
        flat = self._token_rows(meta, verifying)
        batch = self.worker.install(meta, token_rows=flat)
        rows = meta.rows.request_ids if isinstance(meta.rows, DecodeRows) else [r.request_id for r in meta.rows]
        if lead is None:
            tokens = self._tokens(meta, rows, state, verify)
        else:
            n = len(lead.rows)
            own = lead.rows.request_ids if isinstance(lead.rows, DecodeRows) else rows[:n]
            rest = replace(meta, rows=tuple(meta.rows[n:]))
            tokens = torch.cat([self._tokens(lead, own, state), self._tokens(rest, rows[n:], state, verify)])
        at: list[int] | None
        if verifying:  # (where its logits land)
            at, places = Speculation.logits_rows(meta.rows, verify, base)
            where.update(places)
        else:
            # laid out a token a row, each row's last token's logits; else the forward's own (each row's last)
            at = [end - 1 for end in itertools.accumulate(r.query_len for r in meta.rows)] if flat else None
            where.update(zip(rows, range(base, base + len(rows))))
        if self.scorers and meta.phase is Phase.PREFILL and not isinstance(meta.rows, DecodeRows):  # (scored?)
            at = self._scored(meta, at, base)
        at_dev = None if at is None else to_device(at, torch.int64, self.model.device)
        if self.graphs is not None and batch.metadata.phase is Phase.DECODE and self.graphs.fits(batch.num_rows):
            out = self.graphs.decode(tokens, batch)  # (every row's logits: a verify step's positions picked here)
            return out if at is None or at == list(range(len(out))) else out[at_dev]
        out = self.model.forward(
            tokens, batch, self.pool, self.backend, self.layout, *(() if at_dev is None else (at_dev,))
        )
        return out  # type: ignore[no-any-return]

    def _pieces(self, meta: KVMetadata, verify: bool) -> list[KVMetadata]:
        """The forwards ``meta`` runs as: itself, or (a prefill forward, ``pieces`` on) ``graph_pieces``."""
        if verify or not self.pieces or meta.phase is not Phase.PREFILL:
            return [meta]
        return graph_pieces(meta, self.replay_rows)

    def _token_rows(self, meta: KVMetadata, verifying: bool) -> bool:
        """Is this forward laid out one query token a row (the decode kernel, and its graphs where captured)? A
        verify step where its tokens fit the buffers; a prefill forward of causal rows whose tokens a captured
        graph holds and whose reads stay small (a token row reads its whole prefix: at most ``FLAT_READS`` keys in
        all), so that a step carrying a prompt's chunk replays graphs instead of launching every layer's kernels
        from the host (bench/gpu_mixed.py: 33-41 ms a mixed step on an H200, the device busy 6-8 of them)."""
        if meta.phase is not Phase.PREFILL:
            return False
        if verifying:
            return meta.num_query_tokens <= self.worker.token_rows
        if meta.num_query_tokens > self.flat_tokens:
            return False
        if self.batch_invariant:  # (batch-invariant: every forward; shell.invariant)
            return True
        reads = flat_reads(meta.rows)
        return reads is not None and reads <= FLAT_READS

    def _tokens(
        self,
        meta: KVMetadata,
        rows: Sequence[RequestId],
        state: SchedState,
        verify: dict[RequestId, tuple[int, ...]] | None = None,
    ) -> torch.Tensor:
        """The rows' query ids on the model's device: the last step's very ids, else ``query_ids`` copied once."""
        dev = self.model.device
        if isinstance(meta.rows, DecodeRows):
            last = self.last
            if last is not None and last[0] == rows:
                return last[1]
            if last is not None and self.overlapped:  # (ids of the step still in flight: on the device)
                return Overlap.gather(rows, last, self.requests, dev)
            ids = [self.requests[rid].completion.token_ids[-1] for rid in rows]
        else:
            ids = query_ids(meta.rows, state, verify)
        return to_device(ids, torch.int64, dev)
