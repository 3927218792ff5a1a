"""The int4 decoder's head norms and silu(gate) * up in ponder's own arithmetic (small_ops.cpp): close to
torch's in float64, each row's bits its own whatever the batch and the threads, the exponential's edges;
the greedy sampler's argmax: torch.argmax's index, ties, NaN and infinities included."""

import pytest
import torch

from runtime.kernels.cpu_kernels import loaded_argmax, q4_unavailable, small_ops
from runtime.model.sampler import _argmax

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="ponder's CPU kernels need an x86-64 CPU with AVX2")


def _norms_reference(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x[:, :heads * weight.shape[1]].double().view(x.shape[0], heads, -1)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dim", [64, 128, 13])  # a head size with a tail past the last 8 values
def test_head_norms_are_each_head_s_rms_norm(dim):
    head_norms, _ = small_ops()
    generator = torch.Generator().manual_seed(dim)
    heads, extra = 6, 2 * dim  # the values' columns follow the queries' and keys'
    x = torch.randn(5, heads * dim + extra, generator=generator) * 3
    weight = torch.randn(heads, dim, generator=generator)
    out = head_norms(x, heads, weight, 1e-6)
    assert out.shape == (5, heads, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _norms_reference(x, heads, weight, 1e-6), rtol=2e-6, atol=2e-6)
    # a head of zeros is eps's: 0 * (1 / sqrt(eps)) * w
    x[1, :dim] = 0
    assert torch.equal(head_norms(x, heads, weight, 1e-6)[1, 0], torch.zeros(dim))


def test_silu_mul_is_silu_of_the_gate_times_up():
    _, silu_mul = small_ops()
    generator = torch.Generator().manual_seed(3)
    gate = 37  # a tail past the last 8 columns
    x = torch.randn(4, 2 * gate, generator=generator) * 6
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0])
    out = silu_mul(x, gate)
    g, u = x[:, :gate].double(), x[:, gate:].double()
    torch.testing.assert_close(out.double(), g * torch.sigmoid(g) * u, rtol=1e-6, atol=1e-30)
    assert out[0, 2] == x[0, gate + 2] * 100 and out[0, 3] == 0  # exp(-100) is 0 in float32's normal range


def test_a_row_alone_has_the_bits_it_has_in_a_batch():
    head_norms, silu_mul = small_ops()
    generator = torch.Generator().manual_seed(7)
    big = torch.randn(300, 2 * 1536, generator=generator)  # enough rows for several threads' shares
    weight = torch.randn(24, 128, generator=generator)
    batched_norms, batched_act = head_norms(big, 24, weight, 1e-6), silu_mul(big, 1536)
    for row in (0, 151, 299):
        assert torch.equal(head_norms(big[row:row + 1], 24, weight, 1e-6)[0], batched_norms[row])
        assert torch.equal(silu_mul(big[row:row + 1], 1536)[0], batched_act[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(silu_mul(big, 1536), batched_act) and torch.equal(head_norms(big, 24, weight, 1e-6), batched_norms)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    head_norms, silu_mul = small_ops()
    with pytest.raises(RuntimeError, match="silu_mul: x must hold the gate's 5 columns"):
        silu_mul(torch.zeros(2, 11), 5)
    with pytest.raises(RuntimeError, match="head_norms: weight must be"):
        head_norms(torch.zeros(2, 16), 3, torch.zeros(3, 8), 1e-6)


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])  # no full vector, one, many, and a tail
def test_argmax_rows_is_torch_s_argmax(vocab):
    small_ops()  # (the kernels loaded, as a model on them has)
    argmax_rows = loaded_argmax()
    assert argmax_rows is not None
    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=generator).round()  # integers: ties between positions
    last = vocab - 1
    x[1] = float("-inf")  # every position -inf: the first
    x[2, last] = float("inf")
    x[3, last] = float("nan")  # a NaN is torch's maximum (the first NaN), even beside +inf
    x[3, 0] = float("inf")
    x[4, :] = 0.0
    x[4, last // 2:] = -0.0  # -0.0 and 0.0 tie
    x[5, :] = -0.0
    x[6, last // 3] = float("nan")
    x[6, last] = float("nan")
    x[7, :] = x[7].max()  # all equal
    expected = torch.argmax(x, dim=-1)
    assert torch.equal(argmax_rows(x), expected)
    assert torch.equal(_argmax(x), expected)
    assert torch.equal(argmax_rows(x[2:5]), expected[2:5])  # a view of rows: the same rows' indices
    wide = torch.randn(3, 2 * vocab, generator=generator)
    assert torch.equal(argmax_rows(wide[:, ::2].contiguous()), torch.argmax(wide[:, ::2], dim=-1))
    assert torch.equal(argmax_rows(wide[:, :vocab]), torch.argmax(wide[:, :vocab], dim=-1))  # a row stride


def test_argmax_rows_refuses_what_it_cannot_read():
    small_ops()
    argmax_rows = loaded_argmax()
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        argmax_rows(torch.zeros(2, 0))
    assert torch.equal(_argmax(torch.zeros(3, 4)[:, ::2]), torch.zeros(3, dtype=torch.long))  # torch's, strided
