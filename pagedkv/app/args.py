"""What the ``pagedkv`` commands share about their arguments: a parser whose mistakes are one line and
exit 2, the value checks argparse runs on each flag (before torch or a model is loaded), and the CPU
thread count chosen for the machine as it is now."""

from __future__ import annotations

import argparse
import re
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO, NoReturn

USAGE_EXIT = 2  # a usage or input error; 1 is a divergence or a failed run


class UsageError(Exception):
    """A mistake in what the user gave (a flag, a prompts file): one line on stderr, exit 2."""


MAX_LINE_BYTES = 64 << 20  # a line of a prompts file or a trace at most: a whole long-context prompt is a few
# MiB, while a file that never ends a line (/dev/zero, a binary) would otherwise be read until memory runs out


def read_lines(path: str, name: str, *, strict: bool) -> Iterator[str]:
    """The lines of ``path`` (``-``: standard input), read one at a time, each at most ``MAX_LINE_BYTES``:
    ``UsageError`` naming ``name`` when it cannot be opened (now), and, as the lines are read, for a line past
    the bound or (``strict``) one that is not UTF-8 (else such bytes read as U+FFFD)."""
    try:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115 - closed by _lines
    except OSError as e:
        raise UsageError(f"cannot read {name}: {e.strerror}") from None
    return _lines(stream, name, strict, close=path != "-")


def _lines(stream: BinaryIO, name: str, strict: bool, close: bool) -> Iterator[str]:
    try:
        n = 0
        while True:
            try:
                raw = stream.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise UsageError(f"cannot read {name}: {e.strerror or e}") from None
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise UsageError(f"{name} line {n} is longer than {MAX_LINE_BYTES >> 20} MiB (is it a text file?)")
            try:
                yield raw.decode("utf-8", errors="strict" if strict else "replace").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise UsageError(f"{name} line {n} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    finally:
        if close:
            stream.close()


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, once: where it has one (not for switches and unset options) and its help
    does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        if action.help is not None and re.search(r"\bdefault\b", action.help):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with every mistake on one line (the usage block is in ``--help``), defaults in help."""

    def __init__(self, *args: object, **kw: object) -> None:
        kw.setdefault("formatter_class", _Help)
        super().__init__(*args, **kw)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USAGE_EXIT)


def _number(kind: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def bounded_int(low: int, high: int) -> Callable[[str], float]:
    """An integer flag in [low, high]: a value past what the run can allocate or finish is refused up front.

    >>> bounded_int(1, 64)("8")
    8
    >>> bounded_int(1, 64).__name__
    'a positive integer up to 64'
    """
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer from {low}")
    return _number(int, f"{what} up to {high:,}", lambda v: low <= v <= high)


# pagedkv serve's limits on what a client may send (flags of its own: app/serve.py; the routes and connections take
# them: app/openai_api.py, app/connections.py)
MAX_REQUEST_BYTES = 16 << 20  # a request's body at most: larger is a 413, never read whole
READ_TIMEOUT_S = 30.0  # the most a client may take to send its request
KEEP_ALIVE_S = 5  # uvicorn's default: an idle connection after a response

SEED_LIMIT = 1 << 63  # torch's generators take a signed 64-bit seed
positive_int = _number(int, "a positive integer", lambda v: v >= 1)
seed = _number(int, "an integer in [0, 2**63)", lambda v: 0 <= v < SEED_LIMIT)
non_negative_int = _number(int, "a non-negative integer", lambda v: v >= 0)
positive_float = _number(float, "a positive number", lambda v: v > 0)
non_negative_float = _number(float, "a non-negative number", lambda v: v >= 0)
unit_interval = _number(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
penalty = _number(float, "a number in [-2, 2]", lambda v: -2 <= v <= 2)


def device(text: str) -> str:
    """``auto`` (CUDA where there is one: ``resolve_device``), ``cpu``, ``cuda`` or ``cuda:N``: what the shell runs
    on (whether it is there is checked once torch is up).

    >>> device("cuda:1"), device("cpu"), device("auto")
    ('cuda:1', 'cpu', 'auto')
    """
    kind, sep, index = text.partition(":")
    if text in ("cpu", "auto") or (kind == "cuda" and (not sep or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(
        f"must be auto, cpu, cuda or cuda:N, got {text!r} (pagedkv runs on CPUs and NVIDIA GPUs)"
    )


def resolve_device(name: str) -> str:
    """``auto``: ``cuda`` where torch sees a CUDA device, else ``cpu`` (vLLM's choice); any other name as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A byte count as vLLM writes one (``--kv-cache-memory-bytes``): an integer, or one with a suffix, k/m/g/t
    powers of 1000 and K/M/G/T of 1024 (vLLM's ``human_readable_int``); positive, below 2**50.

    >>> byte_size("4096"), byte_size("2G"), byte_size("1.5k")
    (4096, 2147483648, 1500)
    """
    scale = _SUFFIXES.get(text[-1:], 1) if text else 1
    body = text[:-1] if scale != 1 else text
    try:
        value = float(body) * scale if "." in body else int(body) * scale
    except ValueError:
        value = -1
    if not (0 < value < 1 << 50) or int(value) != value:
        raise argparse.ArgumentTypeError(
            f"must be a positive byte count (an integer, or with k, m, g, K, M, G), got {text!r}"
        )
    return int(value)


MAX_THREADS = 1024


def threads(text: str) -> int:
    """``--threads``: ``auto`` (0: ``auto_threads()``) or a count in [1, 1024]."""
    return (
        0
        if text == "auto"
        else int(_number(int, f"an integer in [1, {MAX_THREADS}] or auto", lambda v: 1 <= v <= MAX_THREADS)(text))
    )


def speculative_config(text: str) -> object:
    """``--speculative-config``: vLLM's JSON object (``shell.speculative.SpeculativeConfig``), checked now."""
    from pagedkv.core.config import InvalidConfig
    from pagedkv.shell.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.of(text)
    except InvalidConfig as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("speculative_config ")) from None


def file_name(text: str) -> str:
    """An output file's name: not empty (an empty one was once ignored without a word)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a file name, got ''")
    return text


def writable_target(path: str) -> None:
    """``UsageError`` unless ``path`` could be created or overwritten: its folder exists and it is not a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder")
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{path}: the folder {folder} is not writable")


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies over all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def auto_threads(sample_s: float = 0.15) -> int:
    """Threads for torch's CPU kernels: the CPUs this process may use that are idle now (sampled from
    /proc/stat over ``sample_s``), at least one. torch's default (every core) oversubscribes a busy
    machine: with one other busy process on 2 cores, the README job fell from 53 to 17 tokens/s on two
    threads, and kept 47 on one."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    a = _cpu_times()
    if a is None:
        return usable
    time.sleep(sample_s)
    b = _cpu_times()
    if b is None or b[1] <= a[1]:
        return usable
    idle_cpus = (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or usable)
    return max(1, min(usable, int(idle_cpus + 0.5)))
