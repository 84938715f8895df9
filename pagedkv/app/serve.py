"""``pagedkv serve [MODEL]``: the engine behind OpenAI's HTTP API (app/openai_api.py) on uvicorn, its engine in a
process of its own (app/engine_loop.py). The model, engine and sampling flags are ``generate``'s (vLLM's names);
``--host``, ``--port``, ``--api-key``, ``--served-model-name`` and ``--max-waiting`` are the server's; ``--trace
FILE`` records what the scheduler was given and answered while serving, replayable with ``pagedkv replay``."""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
from dataclasses import replace
from typing import Any

from pagedkv.app.args import (
    KEEP_ALIVE_S,
    MAX_REQUEST_BYTES,
    READ_TIMEOUT_S,
    USAGE_EXIT,
    UsageError,
    bounded_int,
    positive_float,
)

DEFAULT_PORT = 8000


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from pagedkv.app.generate import add_parser as add_engine_flags

    s = add_engine_flags(sub, "serve")
    s.add_argument("model_path", nargs="?", metavar="MODEL", help="the model to serve (as --model)")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    s.add_argument("--port", type=bounded_int(0, 65535), default=DEFAULT_PORT, help="0: any free port")
    s.add_argument("--api-key", metavar="KEY", help="requests must carry 'Authorization: Bearer KEY'")
    s.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: its file's)")
    s.add_argument(
        "--max-waiting",
        type=bounded_int(1, 1 << 20),
        default=1024,
        metavar="N",
        help="sequences that would wait in the scheduler beyond which the server answers 503 with Retry-After",
    )
    s.add_argument(
        "--max-request-bytes",
        type=bounded_int(1024, 1 << 40),
        default=MAX_REQUEST_BYTES,
        metavar="N",
        help="a request's body at most; a larger one is answered 413 unread",
    )
    s.add_argument(
        "--read-timeout",
        type=positive_float,
        default=READ_TIMEOUT_S,
        metavar="S",
        help="seconds a client may take to send its request (head, then body: 408); a connection idle that long "
        "before a request is closed",
    )
    s.add_argument(
        "--max-connections",
        type=bounded_int(16, 1 << 20),
        metavar="N",
        help="connections held at once; past it the longest idle one makes room (default: the descriptors this "
        "process may open, less 256, at most 32768)",
    )
    s.add_argument(
        "--timeout-keep-alive",
        type=bounded_int(1, 3600),
        default=KEEP_ALIVE_S,
        metavar="S",
        help="seconds an idle connection is kept after a response (uvicorn's)",
    )
    return s


def run(args: argparse.Namespace) -> int:
    from pagedkv.app.args import resolve_device
    from pagedkv.app.devices import check_backend, check_device
    from pagedkv.app.generate import open_trace, read_generation_defaults, sampling_defaults
    from pagedkv.models.files import CheckpointError

    try:
        if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
            raise UsageError("serving needs Starlette and uvicorn: pip install 'pagedkv[serve]'")
        if args.model_path and args.model and args.model_path != args.model:
            raise UsageError(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model or args.model_path
        args.device = resolve_device(args.device)
        check_device(args.device, 1)
        check_backend(args.backend, args.device)
        trace = open_trace(args.trace)  # (a path that cannot be written is said now; the engine's process writes it)
        if trace is not None:
            trace.close()
        args.sampling_defaults = read_generation_defaults(args)
        sock = listen(args.host, args.port)
    except (UsageError, CheckpointError) as e:  # (CheckpointError: a generation config that cannot be read)
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return USAGE_EXIT
    import uvicorn

    from pagedkv.app.connections import http_config
    from pagedkv.app.engine_loop import EngineDead, EngineLoop
    from pagedkv.app.openai_api import OpenAIServer

    args.page_map = None
    loop = EngineLoop(build, args, max_waiting=args.max_waiting)
    try:
        loop.start()
    except EngineDead as e:
        sock.close()
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return USAGE_EXIT
    name = args.served_model_name or (args.model or "SmolLM2-135M-Instruct")
    max_tokens = args.max_tokens or args.sampling_defaults.get("max_tokens")  # (None: vLLM's, up to the length)
    defaults = replace(sampling_defaults(args, base={}), max_tokens=max_tokens)  # (vLLM's defaults under the flags)
    server = OpenAIServer(
        loop,
        name,
        defaults=defaults,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
    )
    host, port = sock.getsockname()[:2]
    print(
        f"pagedkv serve: {name} on http://{host}:{port}/v1 (engine on {args.device}; requests of up to "
        f"{loop.max_model_len} tokens)",
        file=sys.stderr,
        flush=True,
    )
    config = http_config(
        server.app(),
        read_timeout=args.read_timeout,
        max_connections=args.max_connections,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    http = uvicorn.Server(config)

    def died(why: str) -> None:  # (a server without its engine stops, so that whatever supervises it restarts it)
        print(f"pagedkv serve: {why}; stopping", file=sys.stderr, flush=True)
        http.should_exit = True

    loop.on_dead = died
    try:
        http.run(sockets=[sock])
    finally:
        loop.close()  # (the engine's process stopped: a trace's end record is written there)
    return 1 if loop.dead is not None else 0


def build(args: argparse.Namespace) -> Any:
    """The engine, in the engine's process (``EngineLoop``'s ``build``): generate's model and engine flags."""
    import torch

    from pagedkv.app.generate import build_engine, engine_threads, open_trace

    torch.set_num_threads(args.threads or engine_threads(args.device))
    engine, _ = build_engine(args, open_trace(args.trace))
    fits = engine.longest_request()
    if args.max_model_len is not None and args.max_model_len > fits:  # (as vLLM: asked for, and not held)
        raise UsageError(
            f"--max-model-len {args.max_model_len} is more than the KV cache holds for one request ({fits} tokens in "
            f"{engine.cache.usable_blocks} blocks of {engine.cache.block_size}): lower it, or give the cache more "
            "memory (--kv-cache-memory-bytes, --gpu-memory-utilization)"
        )
    return engine


def listen(host: str, port: int) -> socket.socket:
    """A socket bound and listening (a port taken, an address not here: a ``UsageError``, before the model loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
