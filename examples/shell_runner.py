"""A complete small model runner over pagedkv: core decides, shell applies.

A two-layer attention-only toy model (seeded weights) prefills two prompts and
decodes three tokens each through the paged KV cache, then checks every decode
step against a dense recompute of the whole sequence. Run it:

    python examples/shell_runner.py
"""

from __future__ import annotations

import torch

from pagedkv.core import RequestSpec, RowSpec, admit, append, commit_many, initial_state, publish
from pagedkv.shell.attention import LayerAttention, get_backend
from pagedkv.shell.pool import PagePool
from pagedkv.shell.rank import attention_layers, build_rank, plan_rank, size_pool
from pagedkv.shell.worker import ForwardBatch

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 2, 8, 50
torch.manual_seed(0)
embed = torch.randn(VOCAB, HEADS * HEAD_DIM)
wq = [torch.randn(HEADS * HEAD_DIM, HEADS * HEAD_DIM) * 0.2 for _ in range(LAYERS)]
wk = [torch.randn(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM) * 0.2 for _ in range(LAYERS)]
wv = [torch.randn(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM) * 0.2 for _ in range(LAYERS)]


def forward(tokens: torch.Tensor, pool: PagePool, batch: ForwardBatch, backend: object) -> torch.Tensor:
    """The model runner's forward: per layer, write this step's K/V once, then attend over pages."""
    x = embed[tokens]  # (tokens, hidden)
    for layer in range(LAYERS):
        q = (x @ wq[layer]).view(-1, HEADS, HEAD_DIM)
        k = (x @ wk[layer]).view(-1, KV_HEADS, HEAD_DIM)
        v = (x @ wv[layer]).view(-1, KV_HEADS, HEAD_DIM)
        pool.write(layer, k, v, batch.slot_mapping)  # once per layer, before attention reads the pages
        spec = LayerAttention(group=0, spec=pool.config.groups[0], scale=HEAD_DIM**-0.5)
        x = x + backend.forward(q, pool.k[layer], pool.v[layer], batch, spec).reshape(x.shape)  # type: ignore[attr-defined]
    return x @ embed.T  # logits (tokens, vocab)


def dense_last_logits(seq: list[int]) -> torch.Tensor:
    """The same model on contiguous K/V with a causal mask: the independent check."""
    x = embed[torch.tensor(seq)]
    for layer in range(LAYERS):
        q = (x @ wq[layer]).view(-1, HEADS, HEAD_DIM).transpose(0, 1)
        k = (x @ wk[layer]).view(-1, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = (x @ wv[layer]).view(-1, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HEAD_DIM**-0.5)
        x = x + att.transpose(0, 1).reshape(x.shape)
    return (x @ embed.T)[-1]


def main() -> None:
    # the model's layers -> the grouping plan -> blocks for the budget -> the core's geometry -> pages and buffers
    plan = plan_rank(
        attention_layers(LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32),
        block_size=4,
        dtype=torch.float32,
    )
    sizing = size_pool(plan, kv_cache_memory_bytes=64 * 1024)
    print("pool:", sizing)
    cfg = plan.cache_config(sizing.num_blocks, max_model_len=64)
    rank = build_rank(plan, cfg, max_rows=8, max_tokens=64)
    pool, worker = rank.pool, rank.worker
    backend = get_backend("torch")
    prompts = {"a": [3, 14, 15, 9, 26, 5], "b": [2, 7, 18, 28, 18]}
    s = initial_state(cfg)
    for rid, p in prompts.items():
        s = admit(s, RequestSpec(rid, (RowSpec.of_tokens(p),))).unwrap().state
    seqs = {rid: list(p) for rid, p in prompts.items()}
    ids = list(prompts)
    meta = publish(s, ids, "prefill").unwrap().effect  # the core's snapshot for this forward
    tokens = torch.tensor([t for rid in ids for t in seqs[rid]])
    for step in range(4):
        batch = worker.install(meta)  # validated against its generation, then written
        logits = forward(tokens, pool, batch, backend)
        last = batch.query_start_loc[1:] - 1  # each row's last query token
        nxt = logits[last].argmax(-1).tolist()
        for rid, row_logits in zip(ids, logits[last]):
            ref = dense_last_logits(seqs[rid])
            err = ((row_logits - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, f"step {step} request {rid}: relative error {err}"
        s = commit_many(s, [(rid, [len(seqs[rid])]) for rid in ids]).unwrap().state
        for rid, t in zip(ids, nxt):
            seqs[rid].append(t)
            s = append(s, rid, [[t]]).unwrap().state
        meta = publish(s, ids, "decode").unwrap().effect
        tokens = torch.tensor(nxt)
    print("paged == dense at every step;", {rid: seq[len(prompts[rid]) :] for rid, seq in seqs.items()})


if __name__ == "__main__":
    main()
