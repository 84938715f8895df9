"""Moved to ``pagedkv.core.verify.invariants``; this module keeps the import path engines and tools used."""

from pagedkv.core.verify.invariants import *  # noqa: F401,F403
