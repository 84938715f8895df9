"""Moved to ``pagedkv.core.verify.check``; this module keeps the import path engines and tools used."""

from pagedkv.core.verify.check import *  # noqa: F401,F403
