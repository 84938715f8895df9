"""KV memory of hybrid models: pagedkv's grouped layout (vLLM's: one block id per group, page tensors shared
by one layer of every group, windows letting blocks go, one state a row for Mamba) against a manager without
groups (every attention layer holding every token; one dense state a request per Mamba layer, as a non-paged
engine holds it), measured by running the core, not by formula.

Part 1, the group layouts of real models (shapes from their config.json files; bf16): one 32k-token request
admitted, its prompt computed (commit), one token decoded; the blocks it holds at each point, times the
plan's bytes per block; and how many such requests a 16 GiB budget holds in steady state.
Part 2, the hybrid test model (transformers' Qwen3 config with sliding and full layers, random weights):
the pool blocks in use during a long generation through the engine, against the same weights served with
every layer full.

    python bench/hybrid_memory.py [--tokens 32768] [--budget-gib 16] [--generate 300]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from pagedkv.core import RequestSpec, RowSpec, admit, append, commit, initial_state
from pagedkv.core.grouping import LayerKind, LayerSpec, plan_groups

GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    name: str
    layers: tuple[LayerSpec, ...]
    note: str


def attn(
    i: int, kind: LayerKind = LayerKind.FULL, *, kv: int, hd: int, window: int | None = None, chunk: int | None = None
) -> LayerSpec:
    return LayerSpec(f"l{i}", kind, kv_heads=kv, head_dim=hd, dtype_bytes=2, window=window, chunk=chunk)


def layouts() -> list[Layout]:
    gemma = [
        attn(i, kv=16, hd=128) if i % 6 == 5 else attn(i, LayerKind.SLIDING_WINDOW, kv=16, hd=128, window=1024)
        for i in range(62)
    ]
    gemma = gemma[: 52 + 10]
    gpt_oss = [
        attn(
            i,
            LayerKind.SLIDING_WINDOW if i % 2 == 0 else LayerKind.FULL,
            kv=8,
            hd=64,
            window=128 if i % 2 == 0 else None,
        )
        for i in range(24)
    ]
    llama4 = [
        attn(i, kv=8, hd=128) if i % 4 == 3 else attn(i, LayerKind.CHUNKED_LOCAL, kv=8, hd=128, chunk=8192)
        for i in range(48)
    ]
    # Jamba v0.1: 32 layers, attention every 8th; a Mamba layer's state: conv (d_inner 8192 x (d_conv 4 - 1)) and
    # SSM (8192 x d_state 16), both bf16: 311,296 bytes
    jamba = [
        attn(i, kv=8, hd=128) if i % 8 == 4 else LayerSpec(f"l{i}", LayerKind.MAMBA, state_bytes=311_296)
        for i in range(32)
    ]
    # Bamba-9B: 32 layers, attention at 9, 18 and 27 (32 heads, 8 KV heads of 128); a Mamba2 layer's state: conv
    # ((8192 + 2 x 128) x 3) and SSM (128 heads x 64 x d_state 128), bf16: 2,147,840 bytes
    bamba_state = 2 * ((8192 + 2 * 128) * 3 + 128 * 64 * 128)
    bamba = [
        attn(i, kv=8, hd=128) if i in (9, 18, 27) else LayerSpec(f"l{i}", LayerKind.MAMBA, state_bytes=bamba_state)
        for i in range(32)
    ]
    return [
        Layout(
            "Gemma-3-27B",
            tuple(gemma),
            f"{sum(x.kind is LayerKind.SLIDING_WINDOW for x in gemma)} sw (1024) + "
            f"{sum(x.kind is LayerKind.FULL for x in gemma)} full, 16 KV heads x 128",
        ),
        Layout("gpt-oss-20b", tuple(gpt_oss), "12 sw (128) + 12 full, 8 KV heads x 64"),
        Layout("Llama-4-style", tuple(llama4), "36 chunked local (8192) + 12 full, 8 KV heads x 128"),
        Layout("Jamba-1:7", tuple(jamba), "4 full + 28 Mamba (311,296-byte states), 8 KV heads x 128"),
        Layout("Bamba-9B", tuple(bamba), "3 full + 29 Mamba2 (2,147,840-byte states), 8 KV heads x 128"),
    ]


def naive_bytes(layout: Layout, tokens: int) -> int:
    """A manager without groups: every attention layer holding every token's K/V at the model's attention shape,
    and each Mamba layer one dense state for the request (what a non-paged engine holds: no padding)."""
    attention = [x for x in layout.layers if x.kind is not LayerKind.MAMBA]
    per_token = max(x.bytes_per_token for x in attention)
    states = sum(x.state_bytes or 0 for x in layout.layers if x.kind is LayerKind.MAMBA)
    return len(attention) * tokens * per_token + states


def measure(layout: Layout, tokens: int) -> dict[str, float]:
    """The core's blocks for one request of ``tokens``: admitted, prompt computed, one token decoded."""
    plan = plan_groups(layout.layers, 16)
    cfg0 = plan.cache_config(2)
    need = cfg0.row_blocks(tokens + 1)
    cfg = plan.cache_config(need + 2, max_model_len=tokens + 1)
    s = initial_state(cfg)
    held = lambda st: cfg.usable_blocks - st.free_blocks  # noqa: E731
    s = admit(s, RequestSpec("r", (RowSpec(tokens),))).unwrap().state
    at_admission = held(s)
    s = commit(s, "r", [tokens]).unwrap().state
    after_prefill = held(s)
    s = append(s, "r", [1]).unwrap().state
    s = commit(s, "r", [tokens + 1]).unwrap().state
    decoding = held(s)
    grown = _grown_peak(cfg, tokens, CHUNK)
    per_block = plan.bytes_per_block
    return {
        "block_size": plan.block_size,
        "groups": len(plan.groups),
        "per_block": per_block,
        "admission": at_admission * per_block,
        "prefill": after_prefill * per_block,
        "decode": decoding * per_block,
        "waste": plan.waste_fraction,
        "grown": grown * per_block,
    }


CHUNK = 2048  # the step budget: a prompt's chunk


def _grown_peak(cfg: object, tokens: int, chunk: int) -> int:
    """The most blocks the request holds while its prompt is computed chunk by chunk with ``grow_prefill``
    (the scheduler's way: admit the first chunk, then grow by a chunk and commit it, to the end)."""
    s = initial_state(cfg)  # type: ignore[arg-type]
    usable = cfg.usable_blocks  # type: ignore[attr-defined]
    first = min(chunk, tokens)
    s = admit(s, RequestSpec("r", (RowSpec(first),))).unwrap().state
    peak = usable - s.free_blocks
    done = 0
    while True:
        s = commit(s, "r", [min(done + chunk, tokens)]).unwrap().state
        done = min(done + chunk, tokens)
        if done == tokens:
            return peak
        s = append(s, "r", [min(chunk, tokens - done)]).unwrap().state
        peak = max(peak, usable - s.free_blocks)


def part1(tokens: int, budget: int) -> None:
    print(
        f"## Part 1: one {tokens:,}-token request, bytes the core holds for it (16 GiB = {budget / GIB:.0f} GiB "
        f"budget)\n"
    )
    print(
        "| model | layout | groups x block | at admission | prompt computed | decoding | attention layers every "
        "token, one dense state a Mamba layer | decoding / naive | decoding requests in budget: pagedkv | naive | admissible in budget | "
        f"padding waste | grow_prefill peak (chunks of {CHUNK}) | admissible with it |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for lay in layouts():
        m = measure(lay, tokens)
        naive = naive_bytes(lay, tokens)
        # n decoding requests fit when n - 1 of them decode and one more is being admitted (its peak)
        fits = 0 if m["admission"] > budget else 1 + int((budget - m["admission"]) // m["decode"])
        print(
            f"| {lay.name} | {lay.note} | {m['groups']} x {m['block_size']} | {m['admission'] / GIB:.2f} GiB | "
            f"{m['prefill'] / GIB:.2f} GiB | {m['decode'] / GIB:.3f} GiB | {naive / GIB:.2f} GiB | "
            f"{m['decode'] / naive:.3f} | {fits} (steady {int(budget // m['decode'])}) | {int(budget // naive)} | "
            f"{'yes' if m['admission'] <= budget else 'NO: the prompt is reserved whole'} | {m['waste']:.1%} | "
            f"{m['grown'] / GIB:.2f} GiB | {'yes' if m['grown'] <= budget else 'NO'} |"
        )
    print(
        "\n'at admission': by default the scheduler admits a prompt whole, so every group holds every prompt "
        "block until the commit lets the windows go; 'decoding requests in budget' admits them one at a time "
        "(one admission peak, the rest decoding), 'steady' if each came in below the peak. 'grow_prefill peak': "
        "with SchedulerConfig(grow_prefill=True) a prompt's blocks come chunk by chunk, as vLLM allocates them, "
        "so a window group holds its window and a chunk.\n"
    )


def part2(new: int, prompt_len: int) -> None:
    import torch

    sys.path.insert(0, "tests")
    from test_hybrid import VOCAB, WINDOW, hf_model

    from pagedkv.models.gguf import LlamaConfig
    from pagedkv.models.llama import IdTokenizer, Llama
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    hf = hf_model("qwen3")
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    hybrid_cfg = LlamaConfig.from_hf_config(hf.config.to_dict())
    full_cfg = LlamaConfig(
        **{
            **{f: getattr(hybrid_cfg, f) for f in hybrid_cfg.__dataclass_fields__},
            "layer_types": None,
            "sliding_window": None,
        }
    )
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    rows = []
    for name, cfg in (("hybrid (2 sw + 2 full)", hybrid_cfg), ("every layer full", full_cfg)):
        eng = Engine(
            Llama(cfg, sd),
            IdTokenizer(),
            block_size=8,
            kv_cache_memory_bytes=8 << 20,
            max_num_seqs=4,
            keep_history=True,
            max_num_batched_tokens=64,
        )
        t0 = time.perf_counter()
        (c,) = eng.generate([("p", prompt, SamplingParams(temperature=0.0, max_tokens=new))])
        seconds = time.perf_counter() - t0
        usable = eng.cache.usable_blocks
        used = [usable - kv.free_blocks for kv in eng.kv_history or []]
        rows.append((name, eng, used, seconds, c.token_ids))
    print(
        f"## Part 2: the hybrid test model (window {WINDOW}, block 8), a {prompt_len}-token prompt and {new} "
        "tokens generated, prefill chunks of 64\n"
    )
    steps = len(rows[0][2]) - 1  # the last snapshot is after the release
    marks = sorted({0, 3, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
    print("| layout | bytes a block | " + " | ".join(f"step {k}" for k in marks) + " | peak | peak bytes |")
    print("|---|---:|" + "---:|" * len(marks) + "---:|---:|")
    for name, eng, used, _, _ in rows:
        per_block = eng.rank.plan.groups.bytes_per_block
        print(
            f"| {name} | {per_block} | "
            + " | ".join(str(used[k]) for k in marks)
            + f" | {max(used)} | {max(used) * per_block / 1024:.0f} KiB |"
        )
    (_, e1, u1, _, _), (_, e2, u2, _, _) = rows
    b1, b2 = e1.rank.plan.groups.bytes_per_block, e2.rank.plan.groups.bytes_per_block
    last = steps - 1
    print(
        f"\nat the last step before the release the hybrid layout holds {u1[last] * b1 / (u2[last] * b2):.2f} of the "
        f"full layout's bytes ({u1[last]} blocks of {b1} vs {u2[last]} of {b2}); at the peak "
        f"{max(u1) * b1 / (max(u2) * b2):.2f}; every block comes back at the release ({u1[-1]} and {u2[-1]} in "
        f"use after it). {len(rows[0][4])} tokens generated in {rows[0][3]:.1f} s (hybrid) and "
        f"{rows[1][3]:.1f} s (full)."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--generate", type=int, default=300)
    p.add_argument("--prompt", type=int, default=200)
    a = p.parse_args()
    part1(a.tokens, int(a.budget_gib * GIB))
    part2(a.generate, a.prompt)


if __name__ == "__main__":
    main()
