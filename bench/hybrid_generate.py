"""Tokens per second of pagedkv serving a Mamba2 hybrid vs transformers' own generate on the same weights, this CPU.

transformers' random-init Bamba and GraniteMoeHybrid (tests/models/test_mamba_hybrid.py's layout at a larger width:
hidden 256, 8 layers, attention at 2 and 6), saved with ``save_pretrained`` and served from the directory; greedy,
fp32, prompts of 200 tokens, ``--new`` new tokens each. Batch 1: one prompt each side; batch 8: pagedkv batches
the 8 prompts, transformers runs them one after another (its hybrid cache pads a batch). Alternating the two
sides ``--repeats`` times; GC on, collections per engine step counted. The tokens are checked equal.

    python bench/hybrid_generate.py [--new 32] [--repeats 2] [--device cuda --mixers torch mamba_ssm]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from typing import Any

import torch

VOCAB = 4096


def hf_model(kind: str) -> Any:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=32,
        mamba_n_groups=1,
        mamba_chunk_size=64,
        mamba_expand=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "bamba":
        return transformers.BambaForCausalLM(
            transformers.BambaConfig(intermediate_size=512, attn_layer_indices=[2, 6], **common)
        ).eval()
    types = ["attention" if i in (2, 6) else "mamba" for i in range(8)]
    return transformers.GraniteMoeHybridForCausalLM(
        transformers.GraniteMoeHybridConfig(
            intermediate_size=128,
            shared_intermediate_size=512,
            num_local_experts=8,
            num_experts_per_tok=2,
            layer_types=types,
            position_embedding_type="rope",
            **common,
        )
    ).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mixers", nargs="+", default=["torch"], help="Mamba mixer backends to time (shell.mixers)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    from pagedkv.models.hf import Weights, hf_config
    from pagedkv.models.hybrid import HybridModel
    from pagedkv.models.llama import IdTokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (200,), generator=g).tolist() for _ in range(8)]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"greedy, 200-token prompts, {args.new} new tokens each, fp32, {where}\n")
    print(
        "| model | mixer | batch | pagedkv tok/s | transformers tok/s | ratio | GC collections / engine step | tokens equal |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for kind in ("bamba", "granite"):
        hf = hf_model(kind)
        path = tempfile.mkdtemp(prefix=f"pagedkv-{kind}-")
        hf.save_pretrained(path)
        hf = hf.to(dev)
        _, config, _ = hf_config(path)
        for mixer, b in ((m, b) for m in args.mixers for b in (1, 8)):
            model = HybridModel(config, Weights(path), device=dev, mixer=mixer)  # type: ignore[arg-type]
            ours, theirs, collections, equal = [], [], 0.0, True
            for _ in range(args.repeats):
                eng = Engine(model, IdTokenizer(), block_size=16, kv_cache_memory_bytes=256 << 20, max_num_seqs=8)
                counts = [0]
                gc.callbacks.append(cb := lambda phase, info: counts.__setitem__(0, counts[0] + (phase == "start")))
                t0 = time.perf_counter()
                done = eng.generate(
                    [
                        (f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=args.new))
                        for i, p in enumerate(prompts[:b])
                    ]
                )
                ours.append(b * args.new / (time.perf_counter() - t0))
                gc.callbacks.remove(cb)
                collections = counts[0] / eng.stats.steps
                t0 = time.perf_counter()
                want = []
                for p in prompts[:b]:
                    ids = torch.tensor([p], device=dev)
                    with torch.no_grad():
                        out = hf.generate(
                            ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=args.new,
                            min_new_tokens=args.new,
                            do_sample=False,
                            pad_token_id=0,
                            eos_token_id=None,
                        )
                    want.append(out[0, len(p) :].tolist())
                theirs.append(b * args.new / (time.perf_counter() - t0))
                equal &= [c.token_ids for c in done] == want
            o, t = max(ours), max(theirs)
            print(
                f"| {type(hf).__name__} | {mixer} | {b} | {o:.0f} | {t:.0f} | {o / t:.2f} | {collections:.2f} | "
                f"{'yes' if equal else 'NO'} |"
            )


if __name__ == "__main__":
    main()
