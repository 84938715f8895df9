"""KV event batches over ZMQ with vLLM's socket semantics (``vllm.distributed.kv_events.ZmqEventPublisher``,
vLLM 0.33 and 0.34), so a subscriber written for vLLM's ``--kv-events-config`` (a PUB endpoint and a replay
ROUTER) reads pagedkv's without a change (``pip install 'pagedkv[vllm]'``: msgspec, pyzmq):

- PUB: each batch is the multipart ``(topic, seq, payload)``: ``seq`` counts batches from 0 as an 8-byte
  big-endian integer, ``payload`` the batch's msgpack (``events.encode``).
- Replay ROUTER: a client (a DEALER or REQ) sends the first ``seq`` it missed, 8 bytes big-endian; it gets
  ``(b"", topic, seq, payload)`` for every batch still buffered from there on, then the end marker
  ``(b"", b"", seq -1 (8 bytes, signed), b"")``. The buffer keeps the last ``buffer_steps`` batches.

A thread owns the sockets (ZMQ sockets are not thread safe); ``publish`` only queues.

    pub = ZmqEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    pub.publish(to_vllm_batch(events, config, ts=time.time()))
    pub.shutdown()
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count

import zmq

from pagedkv.core.errors import InvariantError
from pagedkv.core.config import CacheConfig
from pagedkv.core.outputs.events import KVEvent
from pagedkv.integrations.vllm.events import KVEventBatch, encode, to_vllm_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self.endpoint = _open(self._pub, endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its marker
            self.replay_endpoint = _open(self._replay, replay_endpoint, bind=True)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-kv-events")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch (its data-parallel rank filled in when unset); sent by the publisher thread."""
        if not self._running:
            raise RuntimeError("the publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encode(batch)
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        if self._replay is None:
            raise InvariantError("a replay socket serves replays")
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # (client id, empty delimiter, start seq)
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _open(sock: zmq.Socket[bytes], endpoint: str, *, bind: bool | None = None) -> str:
    """Bind a wildcard, ipc or inproc endpoint (or a replay socket), connect to any other, as vLLM does;
    ``tcp://127.0.0.1:0`` binds a free port. The endpoint as bound."""
    if bind is None:
        bind = (
            "*" in endpoint
            or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://"))
            or endpoint.endswith(":0")
        )
    if not bind:
        sock.connect(endpoint)
        return endpoint
    if endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
        return f"{endpoint.rsplit(':', 1)[0]}:{port}"
    sock.bind(endpoint)
    return endpoint


def hook(
    publisher: ZmqEventPublisher, config: CacheConfig, medium: str | None = "GPU"
) -> Callable[[tuple[KVEvent, ...]], None]:
    """``Engine(on_kv_events=hook(pub, engine_config))``: each step's events, one vLLM batch, published."""

    def publish(events: tuple[KVEvent, ...]) -> None:
        publisher.publish(to_vllm_batch(events, config, ts=time.time(), medium=medium))

    return publish
