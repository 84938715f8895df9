"""Geometry: block size, pool size and KV cache groups.

Block 0 is the null block: never allocated, it stands for positions a windowed
group no longer holds. So a pool of ``num_blocks`` has ``num_blocks - 1`` usable
blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field
from enum import StrEnum

from pagedkv.core.errors import InvariantError, is_int, shown
from pagedkv.core.hashing import BLOCK_HASHES, HASH_WIDTH, hasher
from pagedkv.core.index import GROUP_BITS


class GroupKind(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"  # multi-head latent attention: one latent vector per token; allocates like full attention
    MAMBA = "mamba"  # a state per row (a Mamba layer's conv and SSM state): one block, whatever the length
    # vLLM's mamba_cache_mode="align": the state at each block boundary in that position's own block
    MAMBA_ALIGN = "mamba_align"


class InvalidConfig(ValueError):
    """A geometry that cannot describe a pool (raised at construction)."""


MAX_NUM_BLOCKS = 1 << 31  # a worker's block tables hold int32 ids
FREE_QUEUE_POLICIES = ("tail", "vllm")  # where a freed block goes (docs/prefix-and-groups.md)
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

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise InvalidConfig(f"group name must be a non-empty string, got {shown(self.name)}")
        if self.kind not in tuple(GroupKind):
            raise InvalidConfig(f"group {shown(self.name)}: unknown kind {shown(self.kind)}")
        object.__setattr__(self, "kind", GroupKind(self.kind))
        need = {GroupKind.SLIDING_WINDOW: "window", GroupKind.CHUNKED_LOCAL: "chunk"}.get(self.kind)
        for key in ("window", "chunk"):
            value = getattr(self, key)
            if key == need:
                if not is_int(value) or value < 1:
                    raise InvalidConfig(
                        f"group {shown(self.name)}: {key} must be a positive integer, got {shown(value)}"
                    )
            elif value is not None:
                raise InvalidConfig(f"group {shown(self.name)}: kind {self.kind.value} takes no {key}")

    @property
    def is_windowed(self) -> bool:
        """Does this group let blocks go once no future query can see them?"""
        return self.kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA_ALIGN)

    @property
    def is_aligned_state(self) -> bool:
        """A state group in vLLM's ``mamba_cache_mode="align"``: the state after the row's last token lives at
        its last block position, and each allocation (admission, growth) takes one block there, the positions
        it skips null; a forward reads the state from the previous state block and writes the new one, so the
        state at every block boundary stays in that position's block, is cached under its hash, and a hit
        shares it (the block the hit ends on). As a window of 2 tokens, the blocks before the one holding the
        computed tokens' state go at commit."""
        return self.kind is GroupKind.MAMBA_ALIGN

    @property
    def is_state(self) -> bool:
        """A state group (Mamba): each row holds one block, its state, at its last block position (the null
        block before it); growth moves it, never allocates; it is cached only when its row ends on a block
        boundary, and a hit takes it over (a state is rewritten in place: never shared)."""
        return self.kind is GroupKind.MAMBA

    def first_visible_position(self, position: int) -> int:
        """The first key a query at ``position`` reads (0 unless the group is windowed).

        >>> GroupSpec("w", GroupKind.SLIDING_WINDOW, window=32).first_visible_position(112)
        81
        """
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.window is None:
                raise InvariantError("a sliding-window group has its window")
            return max(0, position - self.window + 1)
        if self.kind is GroupKind.CHUNKED_LOCAL:
            if self.chunk is None:
                raise InvariantError("a chunked-local group has its chunk")
            return position // self.chunk * self.chunk
        if self.kind is GroupKind.MAMBA_ALIGN:  # the state after the token before (vLLM's skipped tokens: n - 1)
            return max(0, position - 1)
        return 0

    def first_visible_block(self, position: int, block_size: int) -> int:
        """The first block any query at ``position`` or later can still see.

        Blocks before it hold nothing a future token reads: a windowed group
        lets them go (the null block takes their place).

        >>> GroupSpec("w", GroupKind.SLIDING_WINDOW, window=32).first_visible_block(112, 16)
        5
        >>> GroupSpec("c", GroupKind.CHUNKED_LOCAL, chunk=32).first_visible_block(112, 16)
        6
        """
        return self.first_visible_position(position) // block_size


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
    free_queue: str = "tail"  # "tail": every freed block to the tail (LRU); "vllm": one without a hash to the head
    reset_prefix_cache: str = "always"  # "always": works while requests run; "when_idle": refused then (vLLM)
    caching_point: str = "commit"  # "commit": full blocks cached once computed; "schedule": once planned (vLLM)
    block_hash: str = "blake2b"  # "blake2b": pagedkv's 16-byte hashes; vLLM's: "sha256", "sha256_cbor", "xxhash"...
    cache_duplicates: bool = False  # False: one block per content; True: every block that fills is cached (vLLM)
    hash_lookahead: int = 0  # ids after each block that its hash also covers (vLLM's EAGLE lookahead hashes)
    kv_events: bool = True  # False: transitions report no KV cache events (vLLM's enable_kv_cache_events off)
    state_group_set: frozenset[int] = field(init=False, repr=False, compare=False)  # the state groups' indices
    paged_groups: int = field(init=False, repr=False, compare=False)  # groups whose blocks grow with the tokens
    aligned_groups: int = field(init=False, repr=False, compare=False)  # align-mode state groups: a block a growth
    has_windows: bool = field(init=False, repr=False, compare=False)  # a group lets blocks go as its window moves
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
        object.__setattr__(self, "state_group_set", frozenset(i for i, g in enumerate(groups) if g.is_state))
        aligned = sum(1 for g in groups if g.is_aligned_state)
        object.__setattr__(self, "aligned_groups", aligned)
        object.__setattr__(self, "paged_groups", len(groups) - len(self.state_group_set) - aligned)
        object.__setattr__(self, "has_windows", any(g.is_windowed for g in groups))
        if groups[0].is_state or groups[0].is_aligned_state:
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
        for key in ("enable_prefix_caching", "cache_duplicates", "kv_events"):
            if type(getattr(self, key)) is not bool:
                raise InvalidConfig(f"{key} must be a boolean, got {shown(getattr(self, key))}")
        if not is_int(self.hash_lookahead) or not 0 <= self.hash_lookahead <= self.block_size:
            raise InvalidConfig(
                f"hash_lookahead must be an integer in [0, block_size], got {shown(self.hash_lookahead)}"
            )
        if self.hash_lookahead and (self.state_group_set or aligned):
            raise InvalidConfig(
                "hash_lookahead with state (Mamba) groups: a saved state is keyed by the hash of the "
                "block it ends, which would wait for ids past the state"
            )
        for key in ("max_rows_per_request", "max_model_len"):
            value = getattr(self, key)
            if value is not None and (not is_int(value) or value < 1):
                raise InvalidConfig(f"{key} must be a positive integer or null, got {shown(value)}")

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def length_limit(self) -> int:
        """``max_model_len``, or a bound no row reaches."""
        return self.max_model_len if self.max_model_len is not None else 1 << 62

    def row_blocks(self, num_tokens: int) -> int:
        """Blocks one row of ``num_tokens`` holds over all groups at most: a block per token block in each
        paged group, one state block in each state group, two in an align-mode one (the state it reads, the
        one it writes)."""
        nb = self.blocks_for(num_tokens)
        return self.paged_groups * nb + len(self.state_group_set) + self.aligned_groups * min(nb, 2)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one group needs for ``num_tokens`` positions: ceil(n / block_size)."""
        return -(-num_tokens // self.block_size)
