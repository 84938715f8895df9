"""pagedkv's pure core: the paged-KV state machine.

No torch, numpy, clocks, randomness or I/O here: every transition is a function
``(state, event) -> Result[Step, KVError]`` over persistent data. Each transition
lives in the module that owns its decision (admission, growth, commit, decode,
release, destination); this package re-exports the public names.
"""

from pagedkv.core.admission import admit, turn_away
from pagedkv.core.commit import cache_ahead, cache_ahead_many, commit, commit_many
from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.decode import commit_decode, decode_step
from pagedkv.core.destination import mark_ready
from pagedkv.core.effects import (
    Admitted,
    Appended,
    Committed,
    Decoded,
    Filled,
    MarkedReady,
    PrefixCacheReset,
    Released,
    ReleaseReason,
    Truncated,
    TurnedAway,
    WasReset,
    takes_generation,
)
from pagedkv.core.errors import ErrorCode, KVError, RequestId
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.core.growth import Placeholders, append, append_decode, append_many
from pagedkv.core.hashing import hash_block, root_hash
from pagedkv.core.kinds import GroupKind
from pagedkv.core.metadata import DecodeRows, KVMetadata, Phase, RowMetadata, Segment
from pagedkv.core.placeholders import fill, fill_many, truncate, truncate_many
from pagedkv.core.release import forget_host, release, release_many, reset, reset_prefix_cache
from pagedkv.core.snapshot import publish
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.state import (
    KVState,
    Step,
    free_queue,
    initial_state,
    request_blocks,
    request_generation,
    row_token_ids,
)
from pagedkv.core.verify.digest import digest

__all__ = [
    "Admitted",
    "AllBlocksCleared",
    "Appended",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "Committed",
    "DecodeRows",
    "Decoded",
    "ErrorCode",
    "Filled",
    "Placeholders",
    "Truncated",
    "TurnedAway",
    "GroupKind",
    "GroupSpec",
    "InvalidConfig",
    "KVError",
    "KVEvent",
    "KVMetadata",
    "KVState",
    "MarkedReady",
    "Phase",
    "PrefixCacheReset",
    "ReleaseReason",
    "Released",
    "RequestId",
    "RequestSpec",
    "RowMetadata",
    "RowSpec",
    "Segment",
    "Step",
    "WasReset",
    "admit",
    "append",
    "append_decode",
    "append_many",
    "cache_ahead",
    "cache_ahead_many",
    "commit",
    "commit_decode",
    "commit_many",
    "decode_step",
    "digest",
    "fill",
    "fill_many",
    "free_queue",
    "hash_block",
    "initial_state",
    "mark_ready",
    "publish",
    "release",
    "release_many",
    "request_blocks",
    "request_generation",
    "reset",
    "reset_prefix_cache",
    "forget_host",
    "root_hash",
    "row_token_ids",
    "takes_generation",
    "truncate",
    "truncate_many",
    "turn_away",
]
