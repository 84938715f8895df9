"""Reading a checkpoint's files: its JSON, and the one error every problem with a checkpoint is."""

from __future__ import annotations

import json
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is: the reason, in one line."""


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing ({what})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
