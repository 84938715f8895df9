"""Reading a checkpoint's files: its JSON, and the one error every problem with a checkpoint is."""

from __future__ import annotations

import json
from typing import Any


# the weights' dtype by vLLM's ``--dtype`` names, as torch's attribute names (no torch here: the command line reads
# them before torch is imported); ``models.hf.weights_dtype`` resolves them, "auto" included
DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is: the reason, in one line."""


MAX_TEXT_BYTES = 256 << 20  # a checkpoint's JSON or template file at most (the largest tokenizer.json served,
# Gemma 3's, is 33 MiB): a path to a device or a pipe that never ends is refused, not read until memory runs out


def read_text(path: str, what: str) -> str:
    """A checkpoint's text file, at most ``MAX_TEXT_BYTES``; ``CheckpointError`` naming ``what`` else."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
        if len(raw) > MAX_TEXT_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_TEXT_BYTES >> 20} MiB ({what})")
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing ({what})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def read_json(path: str, what: str) -> dict[str, Any]:
    text = read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer past 4,300 digits, nesting past Python's depth
        raise CheckpointError(f"{path} is not JSON that can be read: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
