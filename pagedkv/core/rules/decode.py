"""A decode step as one transition for the whole batch: commit what the forward
computed, append the sampled ids.

It is the commit loop (``commit.commit_each``) then the growth loop
(``growth.grow_each``) on one working copy: the same as ``commit_many`` then
``append_many``, as one transition. Each loop does the common row itself (a
number written, an id joining the open block) and hands every other case to the
one general rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from returns.result import Failure, Result, Success

from pagedkv.core.rules.commit import commit_each
from pagedkv.core.outputs.effects import Decoded
from pagedkv.core.errors import KVError, RequestId
from pagedkv.core.rules.growth import decode_batch, grow_each
from pagedkv.core.store.state import KVState, Step
from pagedkv.core.store.txn import Txn


def commit_decode(state: KVState, request_ids: Iterable[RequestId]) -> Result[Step[Decoded], KVError]:
    """The forward computed every position of the named requests: each row is
    committed through its length (full blocks enter the prefix cache).

    The same as ``commit_many`` with each row's length.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9))
    >>> s = admit(s, RequestSpec("a", (RowSpec(3),))).unwrap().state
    >>> commit_decode(s, ["a"]).unwrap().state.row_computed[0]
    3
    """
    return decode_step(state, request_ids, None, append_tokens=False)


def decode_step(
    state: KVState, request_ids: Iterable[RequestId], tokens: Sequence[int] | None, *, append_tokens: bool = True
) -> Result[Step[Decoded], KVError]:
    """One decode step as one transition: every row of the named requests is committed through its
    length (blocks that fill are hashed and cached), then grows by ``tokens[k]`` (``None``: a count).
    The same as ``commit_many`` then ``append_many``; all of it, or nothing.

    >>> from pagedkv.core import CacheConfig, RequestSpec, RowSpec, admit, initial_state
    >>> s = initial_state(CacheConfig(block_size=4, num_blocks=9, enable_prefix_caching=True))
    >>> s = admit(s, RequestSpec("a", (RowSpec.of_tokens([1, 2, 3]),))).unwrap().state
    >>> s = decode_step(s, ["a"], [4]).unwrap().state   # 1 2 3 computed; 4 appended
    >>> step = decode_step(s, ["a"], [5]).unwrap()      # block [1 2 3 4] fills and is cached; 5 opens a block
    >>> len(step.state.cache), step.effect.allocations, step.state.row_len[0]
    (1, (('a', 2),), 5)
    """
    batch = decode_batch(request_ids, tokens)
    if isinstance(batch, KVError):
        return Failure(batch)
    ids, toks = batch
    txn = Txn(state)
    committed = commit_each(txn, ids, None)
    if isinstance(committed, KVError):
        return Failure(committed)
    generations, freed = committed
    if append_tokens:
        grown = grow_each(txn, ids, toks, None)
        if isinstance(grown, KVError):
            return Failure(grown)
        if generations:  # a request's last generation stands, in batch order
            generations = sorted(dict(generations + grown).items())
        else:
            generations = grown
    allocations = tuple((ids[k], gen) for k, gen in generations)
    return Success(Step(txn.done(), Decoded(allocations, freed, tuple(txn.events))))
