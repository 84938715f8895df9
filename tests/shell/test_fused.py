"""The fused elementwise kernels (``shell.fused``) against the torch code they replace, in Triton's interpreter on the
CPU (float32: its bfloat16 is not the device's), each check in a process of its own (the interpreter is chosen when
Triton is first imported). On a GPU, tests/gpu/test_fused.py checks bfloat16 and an engine's tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the fused kernels are Triton's (pip install triton)")


def interpreted(code: str, fused: str = "interpret") -> None:
    """Run ``code`` with Triton's interpreter (the kernels asked for on the CPU: ``PAGEDKV_FUSED=interpret``); its
    assertions are the test's."""
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDKV_FUSED=fused)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_each_kernel_computes_what_the_torch_code_it_replaces_computes() -> None:
    interpreted(
        """
        import torch, torch.nn.functional as F
        from pagedkv.shell import fused

        assert fused.serves(torch.zeros(1))
        torch.manual_seed(0)
        x, y, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)

        def rms(t, w, eps=1e-5):
            tf = t.float()
            return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype) * w

        out, total = fused.rms_norm(y, w, 1e-5, residual=x)
        assert torch.equal(total, x + y)  # (the residual add, exactly)
        assert torch.allclose(out, rms(x + y, w), rtol=1e-5, atol=1e-6), (out - rms(x + y, w)).abs().max()
        out, same = fused.rms_norm(x, w, 1e-5)
        assert same is x and torch.allclose(out, rms(x, w), rtol=1e-5, atol=1e-6)

        gu = torch.randn(3, 2 * 1500)  # (two programs a row)
        g, u = gu.chunk(2, -1)
        assert torch.allclose(fused.silu_mul(gu), F.silu(g) * u, rtol=1e-5, atol=1e-6)

        T, H, KV, D, BS = 6, 6, 2, 16, 4  # (6 query heads: a tile padded to 8)
        qkv = torch.randn(T, (H + 2 * KV) * D)
        pos = torch.tensor([0, 1, 2, 7, 8, 30])
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        fr = pos[:, None].float() * inv[None, :]
        emb = torch.cat((fr, fr), -1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()

        def rope(t):
            half = t.shape[-1] // 2
            return (t.float() * cos + torch.cat((-t[..., half:], t[..., :half]), -1).float() * sin).to(t.dtype)

        q, k, v = torch.split(qkv, [H * D, KV * D, KV * D], -1)
        kp, vp = torch.zeros(5, BS, KV, D), torch.zeros(5, BS, KV, D)
        slots = torch.tensor([4, 5, 6, 9, 10, 19])
        got = fused.rope_write(qkv, cos, sin, kp, vp, slots, H, KV)
        k_want, v_want = torch.zeros(20, KV, D), torch.zeros(20, KV, D)
        k_want[slots], v_want[slots] = rope(k.reshape(-1, KV, D)), v.reshape(-1, KV, D)
        assert torch.equal(got, rope(q.reshape(-1, H, D)))
        assert torch.equal(kp.view(-1, KV, D), k_want) and torch.equal(vp.view(-1, KV, D), v_want)
        """
    )


def test_an_engine_gives_the_same_tokens_with_the_kernels_as_without() -> None:
    """A small random Llama, greedy, prefill chunks and decode steps: the fused forward's tokens and logprobs are the
    torch forward's (float32, where they differ at most in a norm's last place)."""
    interpreted(
        """
        from dataclasses import replace
        import pagedkv.shell.fused as fused
        from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
        from pagedkv.shell.engine import Engine
        from pagedkv.shell.sampling import SamplingParams

        cfg = replace(SMOLLM2_SHAPES, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2)
        model = random_llama(cfg)
        reqs = [(f"r{i}", [(7 * i + j) % 256 for j in range(5 + 9 * i)],
                 SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)) for i in range(3)]

        def run():
            eng = Engine(model, IdTokenizer(), kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=16)
            return [(c.token_ids, [round(next(iter(d.values())).logprob, 4) for d in c.logprobs])
                    for c in eng.generate(reqs)]

        calls = []
        real = fused.rms_norm
        fused.rms_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
        with_kernels = run()
        assert calls  # (the fused path ran)
        fused.ENABLED = False
        assert run() == with_kernels
        """
    )


def test_a_cpu_forward_never_enters_the_interpreter_unless_asked() -> None:
    """TRITON_INTERPRET=1 alone (which other code sets for kernels of its own: vLLM-Omni's tests do, for the whole
    test session) leaves a CPU forward in torch: the kernels' module is not even imported."""
    interpreted(
        """
        import sys
        from dataclasses import replace
        from pagedkv.models.llama import SMOLLM2_SHAPES, IdTokenizer, random_llama
        from pagedkv.shell.engine import Engine
        from pagedkv.shell.sampling import SamplingParams

        cfg = replace(SMOLLM2_SHAPES, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2)
        eng = Engine(random_llama(cfg), IdTokenizer(), kv_cache_memory_bytes=1 << 20)
        eng.generate([("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))])
        assert "pagedkv.shell.fused" not in sys.modules
        """,
        fused="1",
    )
