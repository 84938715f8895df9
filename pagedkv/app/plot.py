"""The page map: which request holds which block over time, drawn with matplotlib (``pip install
'pagedkv[plot]'``) from a sequence of core snapshots (states are values, so keeping them is cheap)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.app.args import UsageError
from pagedkv.core.store.state import KVState, request_blocks

SUFFIXES = (".png", ".svg", ".pdf")
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
)
CACHED_GREY = "#c8c8c8"
MAX_LEGEND_REQUESTS = 24


def check_target(path: str, flag: str = "--page-map") -> None:
    """``UsageError`` unless a page map can be drawn to ``path``: a known suffix, matplotlib, a writable folder
    (checked before the run, so that a bad path never costs the run or its output)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise UsageError(f"{flag} {path}: the file must end in {', '.join(SUFFIXES)}")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{flag} needs matplotlib: pip install 'pagedkv[plot]'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot write in {folder}")


@dataclass(frozen=True, slots=True)
class PageMap:
    """What a page map shows, cell by cell: ``holders[t][b]`` the requests holding block ``b`` after state
    ``t``; ``cached[t]`` the blocks in the prefix cache that no request holds; ``evicted[t]`` the blocks
    whose cached content state ``t`` dropped (reused for other tokens, or the cache reset), ``kept[t]`` those of them
    whose content the host tier kept (core/store/host.py), ``host[t]`` the tier's entries."""

    holders: list[dict[int, tuple[Any, ...]]]
    cached: list[frozenset[int]]
    evicted: list[frozenset[int]]
    usable: int
    kept: list[frozenset[int]] = field(default_factory=list)
    host: list[int] = field(default_factory=list)

    @staticmethod
    def of(states: Sequence[KVState]) -> PageMap:
        if not states:
            raise ValueError("no states to draw")
        holders, cached, evicted, kept, host = [], [], [], [], []
        before: dict[int, Any] = {}
        for s in states:
            held: dict[int, list[Any]] = {}
            for rid in s.requests.keys():
                for row in request_blocks(s, rid):
                    for ids in row:
                        for b in ids:
                            if b and rid not in held.setdefault(b, []):
                                held[b].append(rid)
            keys = {b: s.cache.key_of(b) for b in range(1, s.config.num_blocks)}
            now = {b: k for b, k in keys.items() if k is not None}
            holders.append({b: tuple(r) for b, r in held.items()})
            cached.append(frozenset(b for b in now if b not in held))
            gone = frozenset(b for b, k in before.items() if now.get(b) != k)
            evicted.append(gone)
            kept.append(frozenset(b for b in gone if before[b] in s.host.entries))
            host.append(len(s.host))
            before = now
        return PageMap(holders, cached, evicted, states[0].config.usable_blocks, kept, host)

    def requests(self) -> list[Any]:
        """Every request that held a block, in the order it first did (ties by id)."""
        seen: list[Any] = []
        for step in self.holders:
            new = {r for rids in step.values() for r in rids} - set(seen)
            seen.extend(sorted(new, key=str))
        return seen

    def fill(self) -> dict[str, list[int]]:
        """Blocks per state: held by one request, shared by several, cached and free (the rest are free)."""
        return {
            "held": [sum(len(r) == 1 for r in h.values()) for h in self.holders],
            "shared": [sum(len(r) > 1 for r in h.values()) for h in self.holders],
            "cached": [len(c) for c in self.cached],
        }


def draw(states: Sequence[KVState], title: str = "pagedkv: blocks held", xlabel: str = "step") -> Any:
    """The page map's figure (matplotlib): above, block ids (only as high as any was used) by ``xlabel``,
    each cell in the colour of the request holding it, black dots where several share it (the prefix
    cache), grey where the block is cached but free, red crosses where its cached content was evicted;
    below, the pool's fill over the same axis. A legend names every colour."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise RuntimeError(f"the page map needs matplotlib: pip install 'pagedkv[plot]' ({e})") from None
    pm = PageMap.of(states)
    rids = pm.requests()
    colour = {rid: i % len(PALETTE) for i, rid in enumerate(rids)}
    top = max([b for h in pm.holders for b in h] + [b for c in pm.cached for b in c] + [1])
    steps = len(states)
    grid = np.full((top + 1, steps), np.nan)
    for t, (h, c) in enumerate(zip(pm.holders, pm.cached)):
        for b in c:
            grid[b, t] = len(PALETTE)  # the grey after the requests' colours
        for b, owners in h.items():
            grid[b, t] = colour[owners[0]]
    cmap = ListedColormap([*PALETTE, CACHED_GREY])
    fig, (ax, fill_ax) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(3, 1), layout="constrained")
    ax.imshow(
        np.ma.masked_invalid(grid),
        aspect="auto",
        cmap=cmap,
        interpolation="nearest",
        origin="lower",
        vmin=-0.5,
        vmax=len(PALETTE) + 0.5,
        extent=(-0.5, steps - 0.5, -0.5, top + 0.5),
    )
    shared = [(t, b) for t, h in enumerate(pm.holders) for b, owners in h.items() if len(owners) > 1]
    gone = [(t, b) for t, e in enumerate(pm.evicted) for b in e if b not in pm.kept[t]]
    kept = [(t, b) for t, e in enumerate(pm.kept) for b in e]
    marker = max(2.0, min(30.0, 3000.0 / max(steps, top)))
    if shared:
        ax.scatter(*zip(*shared), s=marker, c="black", marker="o", label="shared by 2+ requests", zorder=3)
    if gone:
        ax.scatter(*zip(*gone), s=marker * 2, c="red", marker="x", label="cached content evicted", zorder=4)
    if kept:
        ax.scatter(
            *zip(*kept), s=marker * 2, c="tab:purple", marker="v", label="evicted, kept in the host tier", zorder=4
        )
    handles = [Patch(color=PALETTE[colour[r]], label=str(r)) for r in rids[:MAX_LEGEND_REQUESTS]]
    if len(rids) > MAX_LEGEND_REQUESTS:
        handles.append(Patch(color="white", label=f"... {len(rids) - MAX_LEGEND_REQUESTS} more (colours repeat)"))
    handles.append(Patch(color=CACHED_GREY, label="cached, free (a later hit reuses it)"))
    marks, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles=handles + marks,
        labels=[h.get_label() for h in handles] + labels,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="requests",
        title_fontsize=8,
    )
    ax.set_ylim(0.5, top + 0.5)  # block 0 is the null block: never held
    ax.set_ylabel(f"block id (1-{top} of {pm.usable})")
    ax.set_title(f"{title}: {len(rids)} requests, {pm.usable} usable blocks")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _fill(fill_ax, pm, steps, xlabel)
    return fig


def _fill(ax: Any, pm: PageMap, steps: int, xlabel: str) -> None:
    """The pool's fill below the map: held by one request, shared, cached and free."""
    from matplotlib.ticker import MaxNLocator

    f = pm.fill()
    ax.stackplot(
        list(range(steps)),
        f["held"],
        f["shared"],
        f["cached"],
        step="mid",
        colors=("tab:blue", "black", CACHED_GREY),
        labels=("held by one request", "shared", "cached, free"),
    )
    if any(pm.host):  # (the host tier's entries, on an axis of their own)
        tier = ax.twinx()
        tier.plot(list(range(steps)), pm.host, color="tab:purple", drawstyle="steps-mid", label="host tier entries")
        tier.set_ylabel("host tier blocks")
        tier.set_ylim(0, max(pm.host) * 1.1)
        tier.legend(loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=8)
    ax.set_ylim(0, pm.usable)
    ax.set_ylabel("blocks")
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="pool fill", title_fontsize=8)


def page_map(states: Sequence[KVState], path: str, title: str = "pagedkv: blocks held", xlabel: str = "step") -> int:
    """Draw ``states`` (one per step or event) to ``path`` (.png, .svg or .pdf); returns the number of requests drawn."""
    fig = draw(states, title, xlabel)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return len(PageMap.of(states).requests())
