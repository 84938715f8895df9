"""fp8 KV pages: accuracy against pages of the model's dtype (CPU, SmolLM2-135M's real weights) and, on a GPU,
the Triton decode kernel over fp8 pages against bf16 pages and against the fp8 HBM floor.

Accuracy (``--device cpu``, the default): the engine's greedy tokens with ``kv_cache_dtype`` fp8_e4m3 and fp8_e5m2
against fp32 pages for the eight chat questions (up to 32 tokens each): where each prompt's tokens first differ, and the
prefill logits' error (max and mean absolute, over the logits' range); the tokens a 64 MiB pool holds.

Speed (``--device cuda``): one decode step of attention, ``seqs`` x ``ctx`` tokens of 8 KV heads x 128 (32 query
heads), shuffled 16-token pages, replayed from a CUDA graph of 20 calls: bf16 pages, fp8 (e4m3) pages, and the fp8
floor (the pages' bytes at the measured copy bandwidth); each checked against fp32 math over the pages' values.

    python bench/kv_fp8.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
    "What is a paged KV cache?",
]


def accuracy(new: int) -> None:
    from pagedkv.core import RequestSpec, RowSpec, admit, publish
    from pagedkv.models.llama import Llama
    from pagedkv.models.tokenizer import Tokenizer
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    model, meta = Llama.smollm2()
    tok = Tokenizer(meta)  # type: ignore[arg-type]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    runs, logits, pools = {}, {}, {}
    for dt in ("auto", "fp8_e4m3", "fp8_e5m2"):
        eng = Engine(model, tok, kv_cache_memory_bytes=64 << 20, max_num_seqs=8, kv_cache_dtype=dt)
        pools[dt] = eng.sizing.tokens
        outs = []
        for i, p in enumerate(prompts):  # the prefill's logits of each prompt, alone
            kv = admit(eng.state.kv, RequestSpec(f"x{i}", (RowSpec.of_tokens(p),))).unwrap().state
            batch = eng.worker.install(publish(kv, [f"x{i}"], "prefill").unwrap().effect)
            outs.append(model.forward(torch.tensor(p), batch, eng.pool, eng.backend, eng.layout)[0])
            eng.worker.remove([f"x{i}"])
        logits[dt] = outs
        runs[dt] = [
            c.token_ids
            for c in eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=new)) for p in prompts])
        ]
    print(
        f"SmolLM2-135M-Instruct, CPU, greedy, {new} tokens for each of {len(prompts)} chat questions; fp32 pages "
        "as the reference\n"
    )
    print(
        "| pages | tokens in 64 MiB | first differing token, per prompt (of the reference's tokens) | prompts equal "
        "to the end | prefill logits: max abs err / range | mean abs err |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for dt in ("auto", "fp8_e4m3", "fp8_e5m2"):
        first = [
            next(
                (i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x) if len(x) == len(y) else min(len(x), len(y))
            )
            for x, y in zip(runs["auto"], runs[dt])
        ]
        ends = sum(x == y for x, y in zip(runs["auto"], runs[dt]))
        err = max(((a - b).abs().max() / (a.max() - a.min())).item() for a, b in zip(logits["auto"], logits[dt]))
        mean = sum((a - b).abs().mean().item() for a, b in zip(logits["auto"], logits[dt])) / len(prompts)
        shown = ", ".join(f"{f}/{len(x)}" for f, x in zip(first, runs["auto"]))
        print(f"| {dt} | {pools[dt]} | {shown} | {ends} / {len(prompts)} | {err:.4f} | {mean:.4f} |")


def speed() -> None:
    import os
    import sys

    import triton

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the repo root
    from bench.gpu_attention import copy_bandwidth, flashinfer_times, in_graph  # the bf16 table's timing and floor
    from pagedkv.shell.attention.triton_decode import auto_programs, paged_decode
    from pagedkv.shell.pool import quantize

    bw = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s\n"
    )
    print(
        "| seqs | ctx | bf16 ms | fp8 ms | fp8 / bf16 | fp8 floor ms | fp8 of its floor | FlashInfer bf16 ms | "
        "FlashInfer fp8 ms | FlashInfer fp8 of floor | rel err bf16 | rel err fp8 | programs a row |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    H, KVH, D, bs = 32, 8, 128, 16
    for B, L in ((8, 32768), (64, 4096), (1, 32768), (256, 1024)):
        nb = L // bs
        n = B * nb + 1
        k = torch.randn(n, bs, KVH, D, device="cuda")
        v = torch.randn(n, bs, KVH, D, device="cuda")
        ks, vs = float(k.abs().max()) / 200, float(v.abs().max()) / 100
        k8, v8 = quantize(k, ks, torch.float8_e4m3fn), quantize(v, vs, torch.float8_e4m3fn)
        kb, vb = k.bfloat16(), v.bfloat16()
        table = (torch.randperm(n - 1, device="cuda")[: B * nb] + 1).view(B, nb).to(torch.int32)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)

        def ref(kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
            kc = kp[table.long()].reshape(B, L, KVH, D).float().transpose(1, 2)
            vc = vp[table.long()].reshape(B, L, KVH, D).float().transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(
                q.float()[:, :, None], kc, vc, scale=D**-0.5, enable_gqa=True
            )[:, :, 0]

        def err(out: torch.Tensor, want: torch.Tensor) -> float:
            return ((out.float() - want).norm() / want.norm()).item()

        e_b = err(paged_decode(q, kb, vb, table, lens, D**-0.5), ref(kb, vb))
        e_8 = err(
            paged_decode(q, k8, v8, table, lens, D**-0.5, kv_scales=(ks, vs)), ref(k8.float() * ks, v8.float() * vs)
        )
        # the kernel as the engine runs it: its own tile and programs a row (auto_programs)
        t_b = in_graph(lambda: paged_decode(q, kb, vb, table, lens, D**-0.5))
        t_8 = in_graph(lambda: paged_decode(q, k8, v8, table, lens, D**-0.5, kv_scales=(ks, vs)))
        floor, splits = 2 * B * L * KVH * D / bw * 1e3, auto_programs(B, KVH, q.device)
        # FlashInfer's decode on the same pages and tables (its graph path, the better of its two kernels)
        fi_b = flashinfer_times(q, kb, vb, table, ref(kb, vb), B, L, bs, H, KVH, D, D**-0.5)["g_fi"]
        fi_8 = flashinfer_times(
            q, k8, v8, table, ref(k8.float() * ks, v8.float() * vs), B, L, bs, H, KVH, D, D**-0.5, kv_scales=(ks, vs)
        )["g_fi"]
        print(
            f"| {B} | {L} | {t_b:.3f} | {t_8:.3f} | {t_8 / t_b:.2f} | {floor:.3f} | {floor / t_8:.2f} | {fi_b:.3f} | "
            f"{fi_8:.3f} | {floor / fi_8:.2f} | {e_b:.1e} | {e_8:.1e} | {splits} |",
            flush=True,
        )


def engine_speed(batch: int = 256, new: int = 48) -> None:
    """The engine's tokens/s with bf16 and fp8 pages: SmolLM2-135M's shapes (random weights: the speed does not
    depend on their values), bf16, triton, CUDA graphs, ``batch`` 128-token prompts, ``new`` tokens each."""
    import time

    from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
    from pagedkv.shell.engine import Engine
    from pagedkv.shell.sampling import SamplingParams

    model = random_llama(SMOLLM2_SHAPES, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (128,), generator=g).tolist() for _ in range(batch)]
    print(
        f"\nthe engine: SmolLM2-135M shapes, bf16, triton, CUDA graphs; {batch} prompts of 128 tokens, {new} new each\n"
    )
    print("| pages | pool tokens (1 GiB) | tok/s (best of 2) | decode step ms (median) |\n|---|---:|---:|---:|")
    for dt in ("auto", "fp8"):
        eng = Engine(
            model,
            IdTokenizer(),
            kv_cache_memory_bytes=1 << 30,
            max_num_seqs=batch,
            max_num_batched_tokens=4096,
            kv_cache_dtype=dt,
            time_steps=True,
        )
        eng.generate([("", p[:8], SamplingParams(temperature=0.0, max_tokens=4)) for p in prompts[:2]])  # warm
        best = 0.0
        for _ in range(2):
            eng.step_times = []
            t0 = time.perf_counter()
            eng.generate([("", p, SamplingParams(temperature=0.0, max_tokens=new)) for p in prompts])
            best = max(best, batch * new / (time.perf_counter() - t0))
        steps = sorted(t for rows, pre, t in eng.step_times or [] if rows == batch and pre == 0)
        print(
            f"| {'bf16' if dt == 'auto' else 'fp8 e4m3'} | {eng.sizing.tokens} | {best:.0f} | "
            f"{steps[len(steps) // 2] * 1e3 if steps else float('nan'):.2f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    if a.device == "cpu":
        accuracy(a.new)
    else:
        speed()
        engine_speed()


if __name__ == "__main__":
    main()
