"""Every transition of the core, re-exported from the module that owns it (this module's
name is the one engines imported before the core was split by who decides):
``admission`` (admit), ``growth`` (append, append_many, append_decode), ``commit``
(commit, commit_many), ``decode`` (decode_step, commit_decode), ``release`` (release,
release_many, reset, reset_prefix_cache), ``destination`` (mark_ready); their
effects are ``effects``'s.
"""

from __future__ import annotations

from pagedkv.core.admission import admit
from pagedkv.core.commit import commit, commit_many
from pagedkv.core.decode import commit_decode, decode_step
from pagedkv.core.destination import mark_ready
from pagedkv.core.effects import (
    Admitted, Appended, Committed, Decoded, MarkedReady, PrefixCacheReset, Released, ReleaseReason, WasReset,
    takes_generation,
)  # fmt: skip
from pagedkv.core.growth import Growth, append, append_decode, append_many
from pagedkv.core.release import release, release_many, reset, reset_prefix_cache

__all__ = [
    "Admitted", "Appended", "Committed", "Decoded", "Growth", "MarkedReady", "PrefixCacheReset", "ReleaseReason",
    "Released", "WasReset", "admit", "append", "append_decode", "append_many", "commit", "commit_decode",
    "commit_many", "decode_step", "mark_ready", "release", "release_many", "reset", "reset_prefix_cache",
    "takes_generation",
]  # fmt: skip
