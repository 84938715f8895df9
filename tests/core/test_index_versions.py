"""The prefix index is a rerooted persistent map (core/store/index.py): every version of a lineage shares one store of
plain dicts. Held beside a model (a plain dict per version, pyrsistent's own tests' way), every version reads as it
was made, whatever was edited, read, refused or interrupted since: edits of old versions (branches), reads of the
edited version in the middle of an edit, edits abandoned half way (a refusal, an exception), and an interrupt that
stops a reroot between its writes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.core.store import index as index_module
from pagedkv.core.store.index import PrefixIndex

HASHES = [bytes([i]) * 16 for i in range(12)]


def contents(idx: PrefixIndex) -> dict[Any, int]:
    """A version as a model reads it: (group, hash) -> blocks, and block -> key."""
    out: dict[Any, Any] = {}
    for key, block in idx.items():
        out.setdefault(key, []).append(block)
        assert idx.key_of(block) == key and idx.is_cached(block)
    assert len(idx) == sum(len(v) for v in out.values()) == idx.cached_blocks()
    return {k: tuple(v) for k, v in out.items()}


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "evict", "add_many", "evict_many", "read_base", "abandon", "commit"]),
        st.integers(0, 1),  # group
        st.integers(0, len(HASHES) - 1),
        st.integers(1, 15),  # block
        st.integers(0, 30),  # which version to edit from
        # (hash, block) pairs of an add_many (block 0: the null block, skipped), blocks of an evict_many
        st.lists(st.tuples(st.integers(0, len(HASHES) - 1), st.integers(0, 15)), max_size=6),
    ),
    max_size=80,
)


def model_add(model: dict[Any, Any], key: Any, b: int, duplicates: bool) -> bool:
    """``add`` as the model has it: added?"""
    taken = any(b in blocks for blocks in model.values())
    fresh = key not in model or duplicates
    if fresh and not taken and b:
        model[key] = model.get(key, ()) + (b,)
        return True
    return False


def model_evict(model: dict[Any, Any], b: int) -> Any:
    """``evict`` as the model has it: the key the block was cached under."""
    key = next((k for k, blocks in model.items() if b in blocks), None)
    if key is not None:
        model[key] = tuple(x for x in model[key] if x != b)
        if not model[key]:
            del model[key]
    return key


@given(ops, st.booleans(), st.sampled_from([1, 2]))
def test_every_version_reads_as_it_was_made(script: list[Any], duplicates: bool, num_groups: int) -> None:
    """Single writes and the batched ones (``add_many``, ``evict_many`` reported or not, which take C-speed bulk
    paths where no pair needs judging one by one) read as the model's writes one at a time."""
    versions = [PrefixIndex.empty(num_blocks=16, num_groups=num_groups)]
    models: list[dict[Any, Any]] = [{}]
    edit, model, base_at = versions[0].edit(duplicates), {}, 0
    for op, g, h, b, pick, many in script:
        g %= num_groups
        if op == "add":
            assert edit.add(g, HASHES[h], b) == model_add(model, (g, HASHES[h]), b, duplicates)
        elif op == "add_many":
            added = sum(model_add(model, (g, HASHES[x]), y, duplicates) for x, y in many)
            assert edit.add_many(g, [HASHES[x] for x, _ in many], [y for _, y in many]) == added
        elif op == "evict":
            assert edit.evict(b) == model_evict(model, b)
        elif op == "evict_many":
            blocks = [y for _, y in many if y] + (list(range(15, 0, -1)) if pick % 3 == 0 else [])  # (or all)
            report = pick % 2 == 0
            gone = [(y, *key) for y in blocks for key in [model_evict(model, y)] if key is not None]
            assert edit.evict_many(blocks, report=report) == (gone if report else [])
        elif op == "read_base":  # (a transition reading its old state mid-edit: the edit rolls back, then on)
            assert contents(versions[base_at]) == models[base_at]
        elif op == "abandon":  # (a refusal or an exception: the edit is dropped, its version never made)
            base_at = pick % len(versions)
            edit, model = versions[base_at].edit(duplicates), dict(models[base_at])
        else:  # commit, then go on from a version taken at random (an old one: a branch)
            versions.append(edit.persistent())
            models.append(dict(model))
            base_at = pick % len(versions)
            edit, model = versions[base_at].edit(duplicates), dict(models[base_at])
        assert {k: tuple(v) for k, v in model.items()} == {
            key: edit.blocks_of(key) for key in model
        }  # (the edit reads its own writes)
    for v, m in zip(versions, models):
        assert contents(v) == m
    for v, m in reversed(list(zip(versions, models))):  # (and again, rerooted the other way)
        assert contents(v) == m


@pytest.mark.parametrize("at", range(1, 12))
def test_an_interrupt_between_a_reroots_writes_is_finished_by_the_next_read(
    at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``KeyboardInterrupt`` stops a reroot after ``at`` of its writes: the store is between two versions, marked
    pending; any read finishes the reroot first, and every version reads as it was made."""
    old = PrefixIndex.empty(num_blocks=16, num_groups=1)
    e = old.edit()
    for i in range(6):
        e.add(0, HASHES[i], i + 1)
    new = e.persistent()
    e = new.edit()
    for i in range(3):
        e.evict(i + 1)
    e.add(0, HASHES[8], 9)
    newer = e.persistent()
    want = {v: contents(v) for v in (old, new, newer)}
    real, writes = index_module._Store.dict_of, [0]

    def dict_of(self: Any, code: int) -> dict[Any, Any]:
        writes[0] += 1
        if writes[0] == at:
            raise KeyboardInterrupt
        return real(self, code)

    monkeypatch.setattr(index_module._Store, "dict_of", dict_of)
    try:
        contents(old)  # (a reroot across two logs: ~14 lookups and writes)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(index_module._Store, "dict_of", real)
    for v in (newer, old, new, newer):
        assert contents(v) == want[v]
