"""``pagedkv generate``'s input: the prompts of the command line and of a prompts file, each checked (valid
Unicode text, its fields' types and bounds) before anything expensive, and the optional outputs' targets."""

from __future__ import annotations

import argparse
import os
import json
import sys
from typing import Any

from pagedkv.app.args import SEED_LIMIT, UsageError, read_lines
from pagedkv.core.errors import shown as shown_value

ITEM_KEYS = ("prompt", "max_tokens", "system")
MAX_TOKENS = (1 << 31) - 1  # a request's max_tokens at most (the model stops far before)


def read_items(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts of the command line and of ``--prompts`` (a line a prompt: a JSON object where it starts with
    ``{``, else its text), each ``{"prompt", "max_tokens", "system"?}`` (its
    ``max_tokens`` None where neither the line nor ``--max-tokens`` names one: the generation config's, once the
    model is loaded, else 64), or ``UsageError`` naming the first bad one (its line in the file)."""
    items: list[dict[str, Any]] = []
    for i, p in enumerate(args.prompt, 1):
        if not p:
            raise UsageError(f"prompt {i} of the command line is empty")
        _text(p, f"prompt {i} of the command line")
        items.append({"prompt": p, "max_tokens": args.max_tokens})
    if args.prompts:
        name = "standard input" if args.prompts == "-" else args.prompts
        for n, line in enumerate(read_lines(args.prompts, name, strict=True), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):  # (a JSON Lines object)
                items.append(_item(line, f"{name} line {n}", args.max_tokens))
            else:  # (a plain line: the prompt, as it is)
                text = line.rstrip("\r\n")
                _text(text, f"{name} line {n}")
                items.append({"prompt": text, "max_tokens": args.max_tokens})
    if not items:
        raise UsageError("no prompts: give them as arguments or with --prompts FILE (- reads standard input)")
    if args.seed + len(items) - 1 >= SEED_LIMIT:
        raise UsageError(f"--seed {args.seed}: request i samples with seed + i, and {len(items)} requests pass 2**63")
    return items


def _text(text: str, where: str) -> None:
    """A prompt is valid Unicode: a lone surrogate (bytes that were not UTF-8, escaped by Python) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where} is not valid UTF-8 text (character {e.start}: {e.reason})") from None


def _item(line: str, where: str, max_tokens: int) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply") from None
    except ValueError as e:  # an integer past Python's 4,300 digits
        raise UsageError(f"{where}: {e}".split(";")[0]) from None
    if not isinstance(obj, dict):
        raise UsageError(f'{where}: expected an object {{"prompt": str, ...}}, got {type(obj).__name__}')
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise UsageError(f'{where}: "prompt" must be a string' + ("" if prompt is None else f", got {prompt!r:.40}"))
    if not prompt:
        raise UsageError(f'{where}: "prompt" is empty')
    _text(prompt, f'{where}: "prompt"')
    n = obj.get("max_tokens", max_tokens)
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_TOKENS):  # (None: the command's default, later)
        raise UsageError(f'{where}: "max_tokens" must be an integer in [1, {MAX_TOKENS}], got {shown_value(n):.40}')
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise UsageError(f'{where}: "system" must be a string, got {shown_value(system):.40}')
    if system:
        _text(system, f'{where}: "system"')
    unknown = [k for k in obj if k not in ITEM_KEYS]
    if unknown:  # a typo (max_token) would silently do nothing: say so, and go on (extra keys were always allowed)
        print(
            f"pagedkv generate: {where}: ignoring {', '.join(map(repr, unknown))} (known keys: {', '.join(ITEM_KEYS)})",
            file=sys.stderr,
        )
    return {"prompt": prompt, "max_tokens": n, **({"system": system} if system else {})}


def check_outputs(args: argparse.Namespace) -> None:
    """``--ranks`` against what it combines with, and the optional outputs before the run (not after it)."""
    if args.ranks > 1 and (args.trace or args.page_map):
        raise UsageError("--trace and --page-map record one engine: use them with --ranks 1")
    if args.ranks > 1 and getattr(args, "speculative_config", None) is not None:
        raise UsageError("--speculative-config is served by one engine: use it with --ranks 1")
    if getattr(args, "async_scheduling", False) and getattr(args, "speculative_config", None) is not None:
        raise UsageError("--async-scheduling with --speculative-config is not served yet: use one of them")
    if args.ranks > 1 and getattr(args, "async_scheduling", False):
        raise UsageError("--async-scheduling is served by one engine: use it with --ranks 1")
    if args.ranks > 1 and getattr(args, "batch_invariant", False):
        raise UsageError("--batch-invariant is served by one engine: use it with --ranks 1")
    if args.ranks > 1 and getattr(args, "model", None):
        raise UsageError("--ranks splits SmolLM2 only: use --model with --ranks 1")
    for flag in ("model", "tokenizer"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.exists(path):
            raise UsageError(f"--{flag} {path} does not exist (a Hugging Face checkpoint directory or a .gguf file)")
    gen = getattr(args, "generation_config", "auto")
    if gen not in ("auto", "vllm") and not os.path.isfile(os.path.join(gen, "generation_config.json")):
        raise UsageError(
            f"--generation-config {gen}: no generation_config.json there (auto, vllm, or a directory holding one)"
        )
    if args.ranks > 1 and getattr(args, "max_model_len", None) is not None:
        raise UsageError("--max-model-len is served by one engine: use it with --ranks 1")
    if args.page_map:
        from pagedkv.app.plot import check_target

        check_target(args.page_map)
