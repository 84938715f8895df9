"""The page map: which request holds which block over time, drawn with matplotlib (``pip install
'pagedkv[plot]'``) from a sequence of core snapshots (states are values, so keeping them is cheap)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.state import KVState, request_blocks


def page_map(states: Sequence[KVState], path: str, title: str = "pagedkv: blocks held per step") -> int:
    """Draw ``states`` (one per step) to ``path`` (PNG); returns the number of requests drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError as e:
        raise RuntimeError(f"the page map needs matplotlib: pip install 'pagedkv[plot]' ({e})") from None
    if not states:
        raise ValueError("no states to draw")
    n = states[0].config.num_blocks
    grid = np.full((n, len(states)), np.nan)
    colour: dict[object, int] = {}
    for t, s in enumerate(states):
        for rid in s.requests.keys():
            for row in request_blocks(s, rid):
                for ids in row:
                    for b in ids:
                        if b:
                            grid[b, t] = colour.setdefault(rid, len(colour)) % 20
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="tab20", interpolation="nearest", origin="lower",
              vmin=0, vmax=19)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("block id")
    ax.set_title(f"{title} ({len(colour)} requests, {n - 1} usable blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(colour)
