"""The Mamba2 mixer's torch reference (shell.mamba): the SSD chunked scan equals the recurrence token by token,
from any state, for any chunk length; the convolution carried across calls equals one call over the whole; the
one-token step over state pages equals the scan; rows starting at 0 ignore what their block held."""

from __future__ import annotations

import torch

from pagedkv.shell.mamba import Mamba2Weights, TorchMixer, conv_prefill, ssd_scan

H, P, N, G, K = 4, 8, 6, 2, 4  # heads, head_dim, d_state, groups, conv kernel
CONV = H * P + 2 * G * N


def weights(chunk: int, seed: int = 0) -> Mamba2Weights:
    g = torch.Generator().manual_seed(seed)
    return Mamba2Weights(
        conv_w=torch.randn(CONV, K, generator=g) / 2,
        conv_b=torch.randn(CONV, generator=g) / 4,
        dt_bias=torch.randn(H, generator=g) / 2,
        A=-torch.rand(H, generator=g) - 0.2,
        D=torch.randn(H, generator=g),
        heads=H,
        head_dim=P,
        groups=G,
        d_state=N,
        chunk=chunk,
    )


def recurrence(
    x: torch.Tensor, dt: torch.Tensor, w: Mamba2Weights, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one token at a time: h = exp(dt A) h + dt x B^T, y = h C + D x."""
    xs, B, C = torch.split(x, [H * P, G * N, G * N], dim=-1)
    ys = []
    for t in range(x.shape[0]):
        d = torch.nn.functional.softplus(dt[t] + w.dt_bias)  # (H,)
        b = B[t].view(G, N).repeat_interleave(H // G, 0)
        c = C[t].view(G, N).repeat_interleave(H // G, 0)
        xt = xs[t].view(H, P)
        state = torch.exp(d * w.A)[:, None, None] * state + (d[:, None] * xt)[:, :, None] * b[:, None, :]
        ys.append(((state * c[:, None, :]).sum(-1) + w.D[:, None] * xt).reshape(-1))
    return torch.stack(ys), state


def test_the_chunked_scan_is_the_recurrence_from_any_state_for_any_chunk() -> None:
    g = torch.Generator().manual_seed(1)
    x, dt = torch.randn(37, CONV, generator=g), torch.randn(37, H, generator=g)
    s0 = torch.randn(H, P, N, generator=g)
    want_y, want_s = recurrence(x, dt, weights(8), s0)
    for chunk in (1, 5, 8, 16, 64):
        y, s = ssd_scan(x, dt, weights(chunk), s0)
        torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s, want_s, rtol=1e-4, atol=1e-4)
    # the carried state matters: from zeros the outputs differ (the test can see a dropped carry)
    assert not torch.allclose(ssd_scan(x, dt, weights(8), torch.zeros_like(s0))[0], want_y, atol=1e-2)


def test_the_convolution_carried_across_calls_is_one_call() -> None:
    g = torch.Generator().manual_seed(2)
    xbc = torch.randn(30, CONV, generator=g)
    w = weights(8)
    whole, end = conv_prefill(xbc, torch.zeros(CONV, K - 1), w)
    a, mid = conv_prefill(xbc[:11], torch.zeros(CONV, K - 1), w)
    b, last = conv_prefill(xbc[11:], mid, w)
    torch.testing.assert_close(torch.cat((a, b)), whole)
    torch.testing.assert_close(last, end)
    torch.testing.assert_close(end, xbc[-(K - 1) :].T)  # the state is the last kernel - 1 inputs


class _Batch:
    """What the mixer reads of a ForwardBatch for rows of one query token each."""

    def __init__(self, kv_start: list[int]) -> None:
        self.num_rows = self.num_tokens = len(kv_start)
        self.kv_start = torch.tensor(kv_start, dtype=torch.int32)


def test_the_step_over_pages_is_the_scan_and_a_fresh_row_ignores_its_block() -> None:
    g = torch.Generator().manual_seed(3)
    w = weights(8)
    x, dt = torch.randn(10, CONV, generator=g), torch.randn(10, H, generator=g)
    conv, ssm = torch.randn(6, CONV, K - 1, generator=g), torch.randn(6, H, P, N, generator=g)  # old garbage
    # row 0 (block 2) prefilled 9 tokens by the scan; then one step of token 9; row 1 (block 4) starts at 0
    h, s = conv_prefill(x[:9], torch.zeros(CONV, K - 1), w)
    conv[2], ssm[2] = s, ssd_scan(h, dt[:9], w, torch.zeros(H, P, N))[1]
    blocks = torch.tensor([2, 4])
    y = TorchMixer().forward(
        torch.stack((x[9], x[0])), torch.stack((dt[9], dt[0])), w, conv, ssm, blocks, _Batch([9, 0])
    )  # type: ignore[arg-type]
    full = ssd_scan(conv_prefill(x, torch.zeros(CONV, K - 1), w)[0], dt, w, torch.zeros(H, P, N))[0]
    torch.testing.assert_close(y[0], full[9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[1], full[0], rtol=1e-4, atol=1e-4)  # block 4's garbage never read
    torch.testing.assert_close(conv[4], torch.cat((torch.zeros(CONV, K - 2), x[0][:, None]), dim=-1))
