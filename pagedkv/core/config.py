"""Geometry: block size, pool size and KV cache groups.

Block 0 is the null block: never allocated, it stands for positions a windowed
group no longer holds. So a pool of ``num_blocks`` has ``num_blocks - 1`` usable
blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.errors import is_int, shown
from pagedkv.core.rules.hashing import BLOCK_HASHES, HASH_WIDTH, hasher
from pagedkv.core.store.index import GROUP_BITS
from pagedkv.core.rules.kinds import RULES, GroupKind, KindRules


class InvalidConfig(ValueError):
    """A geometry that cannot describe a pool (raised at construction)."""


MAX_NUM_BLOCKS = 1 << 31  # a worker's block tables hold int32 ids
FREE_QUEUE_POLICIES = ("tail", "vllm", "vllm-omni")  # where a freed block goes (docs/prefix-and-groups.md)
RESET_POLICIES = ("always", "when_idle")  # when reset_prefix_cache may drop the hashes
CACHING_POINTS = ("commit", "schedule")  # when a full block's hash enters the prefix cache


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: layers that share block ids and one attention kind.

    >>> GroupSpec("local", GroupKind.SLIDING_WINDOW, window=32).window
    32
    """

    name: str
    kind: GroupKind = GroupKind.FULL
    window: int | None = None  # sliding_window: a token sees itself and window - 1 before it
    chunk: int | None = None  # chunked_local: a token sees its chunk from the chunk's start
    rules: KindRules = field(init=False, repr=False, compare=False)  # what the kind does (core/rules/kinds.py)

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise InvalidConfig(f"group name must be a non-empty string, got {shown(self.name)}")
        if self.kind not in tuple(GroupKind):
            raise InvalidConfig(f"group {shown(self.name)}: unknown kind {shown(self.kind)}")
        object.__setattr__(self, "kind", GroupKind(self.kind))
        need = RULES[self.kind].parameter
        for key in ("window", "chunk"):
            value = getattr(self, key)
            if key == need:
                if not is_int(value) or value < 1:
                    raise InvalidConfig(
                        f"group {shown(self.name)}: {key} must be a positive integer, got {shown(value)}"
                    )
            elif value is not None:
                raise InvalidConfig(f"group {shown(self.name)}: kind {self.kind.value} takes no {key}")
        object.__setattr__(self, "rules", RULES[self.kind](self.window, self.chunk))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The pool's geometry and the limits admission enforces.

    >>> c = CacheConfig(block_size=16, num_blocks=9)
    >>> c.usable_blocks, c.groups[0].kind.value
    (8, 'full')
    """

    block_size: int
    num_blocks: int  # including the null block 0
    groups: tuple[GroupSpec, ...] = field(default=(GroupSpec("full"),))
    enable_prefix_caching: bool = False
    max_rows_per_request: int | None = None
    max_model_len: int | None = None
    hash_namespace: str = "pagedkv"  # the root of every block-hash chain
    free_queue: str = "tail"  # "tail": every freed block to the tail (LRU); "vllm": one without a hash to the head;
    # "vllm-omni": as "vllm", a request's rows let go one by one, the last first (vLLM-Omni's diffusion KV manager)
    reset_prefix_cache: str = "always"  # "always": works while requests run; "when_idle": refused then (vLLM)
    caching_point: str = "commit"  # "commit": full blocks cached once computed; "schedule": once planned (vLLM)
    block_hash: str = "blake2b"  # "blake2b": pagedkv's 16-byte hashes; vLLM's: "sha256", "sha256_cbor", "xxhash"...
    cache_duplicates: bool = False  # False: one block per content; True: every block that fills is cached (vLLM)
    hash_lookahead: int = 0  # ids after each block that its hash also covers (vLLM's EAGLE lookahead hashes)
    kv_events: bool = True  # False: transitions report no KV cache events (vLLM's enable_kv_cache_events off)
    check_given_hashes: bool = False  # True: block hashes a caller gives (RequestSpec.block_hashes) are checked
    # a second tier of the prefix cache (vLLM's --kv-offloading-size): a cached block the pool evicts is kept in one
    # of this many host blocks (its own LRU), and a hit there loads it back (core/store/host.py); 0: off
    host_blocks: int = 0
    # which evicted blocks the tier keeps (vLLM's offloading store_threshold): at 2 or more, only a content seen in
    # this many uses (a row computing it, an admission hitting it), counted in a table of ``host_tracker_size``
    # contents (its least recently used dropped); below 2 every evicted block (core/store/host.py)
    host_store_threshold: int = 0
    host_tracker_size: int = 64_000
    rules: tuple[KindRules, ...] = field(init=False, repr=False, compare=False)  # each group's (core/rules/kinds.py)
    state_group_set: frozenset[int] = field(init=False, repr=False, compare=False)  # groups whose block is a live state
    opening_blocks: int = field(init=False, repr=False, compare=False)  # blocks a row's growth takes a block it opens
    letting_go: tuple[KindRules, ...] = field(init=False, repr=False, compare=False)  # rules whose window moves
    recurrent: bool = field(init=False, repr=False, compare=False)  # a group carries a state from token to token
    stops_at_block_end: bool = field(init=False, repr=False, compare=False)  # a forward ends at its block's end
    hash_width: int = field(init=False, repr=False, compare=False)  # bytes a block hash (block_hash's)
    hash_fn: Callable[[bytes, bytes, Any], bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.hash_namespace) is not str:
            raise InvalidConfig(f"hash_namespace must be a string, got {shown(self.hash_namespace)}")
        try:
            self.hash_namespace.encode("utf-8")  # the root hash digests its UTF-8 bytes
        except UnicodeEncodeError:
            raise InvalidConfig(
                f"hash_namespace must be valid Unicode text (it is hashed as UTF-8), got {shown(self.hash_namespace)}"
            ) from None
        if not is_int(self.block_size) or not 1 <= self.block_size < MAX_NUM_BLOCKS:  # slots fit 62 bits
            raise InvalidConfig(f"block_size must be a positive integer below 2**31, got {shown(self.block_size)}")
        if not is_int(self.num_blocks) or not 2 <= self.num_blocks < MAX_NUM_BLOCKS:
            raise InvalidConfig(
                f"num_blocks must be an integer in [2, 2**31) (block 0 is the null block; block tables hold 32-bit "
                f"ids), got {shown(self.num_blocks)}"
            )
        groups = tuple(self.groups)
        if not groups:
            raise InvalidConfig("groups must name at least one KV cache group")
        if len(groups) > 1 << GROUP_BITS:  # (the prefix index keeps a cached block's group in GROUP_BITS bits)
            raise InvalidConfig(f"at most {1 << GROUP_BITS} KV cache groups, got {len(groups)}")
        for g in groups:
            if not isinstance(g, GroupSpec):
                raise InvalidConfig(f"groups must hold GroupSpec values, got {shown(g)}")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise InvalidConfig(f"group names must be unique, got {names}")
        object.__setattr__(self, "groups", groups)
        rules = tuple(g.rules for g in groups)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "state_group_set", frozenset(i for i, r in enumerate(rules) if r.holds_state))
        object.__setattr__(self, "opening_blocks", sum(r.growth_blocks(1) for r in rules))
        object.__setattr__(self, "letting_go", tuple(r for r in rules if r.lets_go))
        object.__setattr__(self, "recurrent", any(r.recurrent for r in rules))
        object.__setattr__(self, "stops_at_block_end", any(r.stops_at_block_end for r in rules))
        if rules[0].recurrent:
            raise InvalidConfig(
                f"group 0 ({shown(groups[0].name)}) is a state group; the first group must be an "
                "attention group (its blocks give the rows' slots)"
            )
        for key, allowed in (
            ("free_queue", FREE_QUEUE_POLICIES),
            ("reset_prefix_cache", RESET_POLICIES),
            ("caching_point", CACHING_POINTS),
            ("block_hash", BLOCK_HASHES),
        ):
            if getattr(self, key) not in allowed or type(getattr(self, key)) is not str:
                raise InvalidConfig(
                    f"{key} must be one of {', '.join(map(repr, allowed))}, got {shown(getattr(self, key))}"
                )
        object.__setattr__(self, "hash_width", HASH_WIDTH[self.block_hash])
        try:
            object.__setattr__(self, "hash_fn", hasher(self.block_hash))
        except ValueError as e:  # a kind whose package is absent
            raise InvalidConfig(str(e)) from None
        for key in ("enable_prefix_caching", "cache_duplicates", "kv_events", "check_given_hashes"):
            if type(getattr(self, key)) is not bool:
                raise InvalidConfig(f"{key} must be a boolean, got {shown(getattr(self, key))}")
        if not is_int(self.hash_lookahead) or not 0 <= self.hash_lookahead <= self.block_size:
            raise InvalidConfig(
                f"hash_lookahead must be an integer in [0, block_size], got {shown(self.hash_lookahead)}"
            )
        if self.hash_lookahead and self.recurrent:
            raise InvalidConfig(
                "hash_lookahead with state (Mamba) groups: a saved state is keyed by the hash of the "
                "block it ends, which would wait for ids past the state"
            )
        for key in ("max_rows_per_request", "max_model_len"):
            value = getattr(self, key)
            if value is not None and (not is_int(value) or value < 1):
                raise InvalidConfig(f"{key} must be a positive integer or null, got {shown(value)}")
        if not is_int(self.host_blocks) or not 0 <= self.host_blocks < 1 << 31:
            raise InvalidConfig(f"host_blocks must be an integer in [0, 2**31), got {shown(self.host_blocks)}")
        if self.host_blocks and not self.enable_prefix_caching:
            raise InvalidConfig("host_blocks (a host tier for the prefix cache) needs prefix caching")
        for key, low in (("host_store_threshold", 0), ("host_tracker_size", 1)):
            value = getattr(self, key)
            if not is_int(value) or not low <= value < 1 << 31:
                raise InvalidConfig(f"{key} must be an integer in [{low}, 2**31), got {shown(value)}")
        if self.host_store_threshold > 1 and not self.host_blocks:
            raise InvalidConfig("host_store_threshold chooses what the host tier keeps: it needs host_blocks")

    @property
    def has_windows(self) -> bool:
        """Does a group let blocks go as its window moves?"""
        return bool(self.letting_go)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def length_limit(self) -> int:
        """``max_model_len``, or a bound no row reaches."""
        return self.max_model_len if self.max_model_len is not None else 1 << 62

    def row_blocks(self, num_tokens: int) -> int:
        """Blocks one row of ``num_tokens`` holds over all groups at most (each kind's ``most_held``)."""
        nb = self.blocks_for(num_tokens)
        return sum(r.most_held(nb) for r in self.rules)

    def held_growing(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one row of ``num_tokens`` holds over all groups while it is computed ``chunk`` tokens at
        a time, from whatever point (a forward from p holds what p's queries see through p + chunk: each kind's
        ``held_computing``): what the pool must hold for a row whose blocks come chunk by chunk. A chunk of 1 is
        a decode's: what the row holds running to that length.

        >>> w = GroupSpec("w", GroupKind.SLIDING_WINDOW, window=4)
        >>> cfg = CacheConfig(block_size=4, num_blocks=40, groups=(GroupSpec("full"), w))
        >>> cfg.held_growing(41, 4), cfg.held_growing(41, 1)
        (14, 13)
        """
        bs, rules = self.block_size, self.rules
        last = max(0, num_tokens - chunk)  # (a forward from past it ends at the row's end: it holds less)
        span = math.lcm(*(r.period(bs) for r in rules))  # (before it, a start's count is one of these less)
        return max(
            sum(r.held_computing(p, min(p + chunk, num_tokens), bs) for r in rules)
            for p in range(max(0, last - span), last + 1)
        )

    def growing_chunk(self, num_tokens: int, chunk: int) -> int:
        """The largest chunk up to ``chunk`` in which a row of ``num_tokens`` fits the pool grown chunk by chunk
        (``held_growing``), 0 where not even a token at a time does: a long row near the pool's size is computed in
        smaller chunks rather than refused (its windows then hold less at once)."""
        usable = self.usable_blocks
        if self.row_blocks(num_tokens) <= usable or self.held_growing(num_tokens, chunk) <= usable:
            return chunk
        if self.held_growing(num_tokens, 1) > usable:
            return 0
        fits, over = 1, chunk  # (held_growing grows with the chunk)
        while over - fits > 1:
            mid = (fits + over) // 2
            fits, over = (mid, over) if self.held_growing(num_tokens, mid) <= usable else (fits, mid)
        return fits

    def growth_blocks(self, opened: int) -> int:
        """Blocks a row's growth that opens ``opened`` positions takes over all groups (each kind's
        ``growth_blocks``)."""
        return (
            self.opening_blocks * opened if len(self.rules) == 1 else sum(r.growth_blocks(opened) for r in self.rules)
        )

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one group needs for ``num_tokens`` positions: ceil(n / block_size)."""
        return -(-num_tokens // self.block_size)
