"""Moved to ``pagedkv.core.verify.digest``; this module keeps the import path engines and tools used."""

from pagedkv.core.verify.digest import *  # noqa: F401,F403
