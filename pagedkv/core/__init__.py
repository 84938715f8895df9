"""pagedkv's pure core: the paged-KV state machine.

No torch, numpy, clocks, randomness or I/O here: every transition is a function
``(state, event) -> Result[Step, KVError]`` over persistent data. Each transition
lives in the module that owns its decision (admission, growth, commit, decode,
release, destination); this package re-exports the public names.
"""

from pagedkv.core.rules.admission import admit, turn_away
from pagedkv.core.rules.commit import cache_ahead, cache_ahead_many, commit, commit_many
from pagedkv.core.config import CacheConfig, GroupSpec, InvalidConfig
from pagedkv.core.rules.decode import commit_decode, decode_step
from pagedkv.core.rules.destination import mark_ready
from pagedkv.core.outputs.effects import (
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
from pagedkv.core.outputs.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.core.rules.growth import Placeholders, append, append_decode, append_many
from pagedkv.core.rules.hashing import hash_block, root_hash
from pagedkv.core.rules.kinds import GroupKind
from pagedkv.core.outputs.metadata import DecodeRows, KVMetadata, Phase, RowMetadata, Segment
from pagedkv.core.rules.placeholders import fill, fill_many, truncate, truncate_many
from pagedkv.core.rules.release import forget_host, release, release_many, reset, reset_prefix_cache
from pagedkv.core.outputs.snapshot import publish
from pagedkv.core.spec import RequestSpec, RowSpec
from pagedkv.core.store.state import (
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
