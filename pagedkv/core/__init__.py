"""pagedkv's pure core: the paged-KV state machine.

No torch, numpy, clocks, randomness or I/O here: every transition is a function
``(state, event) -> Result[Step, KVError]`` over persistent data.
"""

from pagedkv.core.config import CacheConfig, GroupKind, GroupSpec, InvalidConfig
from pagedkv.core.digest import digest
from pagedkv.core.errors import ErrorCode, KVError, RequestId
from pagedkv.core.metadata import DecodeRows, KVMetadata, Phase, RowMetadata, Segment, publish
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.state import KVState, Step, free_queue, initial_state, request_blocks, request_generation, row_token_ids
from pagedkv.core.transitions import (
    Admitted,
    Appended,
    Committed,
    Decoded,
    PrefixCacheReset,
    Released,
    ReleaseReason,
    WasReset,
    admit,
    append,
    append_decode,
    append_many,
    commit,
    commit_decode,
    commit_many,
    decode_step,
    mark_ready,
    MarkedReady,
    release,
    release_many,
    reset,
    reset_prefix_cache,
)
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.core.hashing import hash_block, root_hash

__all__ = [
    "Admitted", "Appended", "CacheConfig", "DecodeRows", "Committed", "ErrorCode", "GroupKind", "GroupSpec",
    "InvalidConfig", "KVError", "KVMetadata", "KVState", "Phase", "ReleaseReason", "Released",
    "RequestId", "RequestSpec", "RowMetadata", "RowSpec", "Segment", "Step", "WasReset", "admit",
    "append", "append_decode", "append_many", "commit", "commit_decode", "commit_many", "Decoded", "decode_step", "mark_ready", "MarkedReady", "digest", "free_queue", "initial_state",
    "publish", "release", "release_many", "request_blocks", "request_generation", "row_token_ids", "reset", "reset_prefix_cache", "PrefixCacheReset",
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "hash_block", "root_hash",
]  # fmt: skip
