"""Incremental detokenisation: a request's text grows by each new token's piece, never by
decoding the whole sequence again.

Byte-level BPE can split one character over several tokens, and a token's text can depend on the
token before it (a leading space), so each new piece is read from a short window: the ids from
the last settled token on, decoded once with the new id and once without; the difference is the
new text, held back while it ends in an unfinished character (U+FFFD). This is the scheme of
Hugging Face's ``TextStreamer`` and vLLM's detokenizer.
"""

from __future__ import annotations

from typing import Any


class TextSoFar:
    """The text of ``ids`` as they arrive; ``push`` returns what the new id added (maybe '')."""

    __slots__ = ("_tok", "ids", "text", "_prefix", "_read")

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before: str = self._tok.decode(self.ids[self._prefix : self._read])
        now: str = self._tok.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing settled yet: wait for the rest of the character
        piece = now[len(before) :]
        self.text += piece
        self._prefix, self._read = self._read, len(self.ids)
        return piece

    def holds(self, stop: tuple[str, ...], piece: str) -> bool:
        """Whether a stop string ends within the text ``piece`` just added (each is looked for only
        where it could overlap the new text)."""
        if not piece:
            return False
        tail = self.text
        return any(s in tail[max(len(tail) - len(piece) - len(s) + 1, 0) :] for s in stop)
