"""Qwen3.5's int4 layers' small operators in ponder's own arithmetic (hybrid_ops.cpp): close to
transformers' arithmetic in float64 (the gated norm, the (1 + w) head norms with the partial rotary, the
output gate), each row's bits its own whatever the batch and the threads, bad shapes refused."""

import pytest
import torch

from runtime.kernels.cpu_kernels import hybrid_ops, q4_unavailable

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="ponder's CPU kernels need an x86-64 CPU with AVX2")


def _norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.double()


def _rotation(tokens: int, rotary: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, 1, R]` as runtime.model.qwen35_layers.HybridDecoder.rotation gives them (sin's
    first half negated)."""
    angles = torch.rand(tokens, rotary // 2, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)
    sin = angles.sin()
    return angles.cos()[:, None], torch.cat((-sin[:, :rotary // 2], sin[:, rotary // 2:]), dim=-1)[:, None]


@pytest.mark.parametrize("width", [64, 13])  # a head size with a tail past the last 8 values
def test_gated_norm_is_qwen35_s_gated_rms_norm(width):
    gated_norm, _, _ = hybrid_ops()
    generator = torch.Generator().manual_seed(width)
    tokens, heads = 5, 6
    core = torch.randn(tokens * heads, width, generator=generator) * 3
    projections = torch.randn(tokens, 3 * heads * width, generator=generator) * 4
    z = projections[:, heads * width:2 * heads * width]  # a view of a wider projection's output, as the loop's
    weight = torch.randn(width, generator=generator)
    out = gated_norm(core, z, weight, 1e-6)
    expected = _norm(core, weight, 1e-6) * torch.nn.functional.silu(z.double().reshape(-1, width))
    assert out.shape == (tokens, heads * width)
    torch.testing.assert_close(out.double(), expected.reshape(tokens, -1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dim, rotary", [(64, 16), (128, 128), (24, 8)])
def test_qk_heads_norm_the_queries_and_keys_and_rotate_their_first_features(dim, rotary):
    _, qk_heads, _ = hybrid_ops()
    generator = torch.Generator().manual_seed(dim + rotary)
    tokens, heads, kv_heads = 4, 6, 2
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim, generator=generator) * 3
    q_scale, k_scale = 1 + torch.randn(dim, generator=generator), 1 + torch.randn(dim, generator=generator)
    cos, sin = _rotation(tokens, rotary, generator)
    out = qk_heads(qkv, heads, kv_heads, dim, q_scale, k_scale, 1e-6, 1e-5, cos, sin)
    queries = qkv[:, :2 * heads * dim].view(tokens, heads, 2 * dim)[..., :dim]
    keys = qkv[:, 2 * heads * dim:(2 * heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    qk = torch.cat((_norm(queries, q_scale, 1e-6), _norm(keys, k_scale, 1e-5)), dim=1)
    turned = qk[..., :rotary]
    turned = turned * cos.double() + torch.roll(turned, rotary // 2, dims=-1) * sin.double()
    expected = torch.cat((turned, qk[..., rotary:]), dim=-1)
    assert out.shape == (tokens, heads + kv_heads, dim)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_sigmoid_gate_scales_each_head_by_its_gate():
    _, _, sigmoid_gate = hybrid_ops()
    generator = torch.Generator().manual_seed(5)
    tokens, heads, dim = 3, 4, 20  # a tail past the last 8 values of a head
    x = torch.randn(tokens, heads * dim, generator=generator)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=generator) * 8
    qkv[0, dim:dim + 4] = torch.tensor([0.0, 100.0, -100.0, -88.0])
    out = sigmoid_gate(x, qkv, heads, dim)
    gate = qkv[:, :2 * heads * dim].view(tokens, heads, 2 * dim)[..., dim:].reshape(tokens, -1)
    torch.testing.assert_close(out.double(), x.double() * torch.sigmoid(gate.double()), rtol=1e-6, atol=1e-30)
    assert out[0, 1] == x[0, 1] and out[0, 2] == 0  # sigmoid(100) is 1, exp(-100) is 0 in float32's normal range


def test_a_row_alone_has_the_bits_it_has_in_a_batch():
    gated_norm, qk_heads, sigmoid_gate = hybrid_ops()
    generator = torch.Generator().manual_seed(9)
    tokens, heads, kv_heads, dim, rotary = 300, 8, 2, 64, 16  # enough rows for several threads' shares
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * dim, generator=generator)
    core = torch.randn(tokens * heads, dim, generator=generator)
    x = torch.randn(tokens, heads * dim, generator=generator)
    scale = torch.randn(dim, generator=generator)
    cos, sin = _rotation(tokens, rotary, generator)

    def ops(rows: slice) -> tuple[torch.Tensor, ...]:
        first, last = rows.start, rows.stop
        return (gated_norm(core[first * heads:last * heads], qkv[rows, :heads * dim], scale, 1e-6),
                qk_heads(qkv[rows], heads, kv_heads, dim, scale, scale, 1e-6, 1e-6, cos[rows].contiguous(),
                         sin[rows].contiguous()),
                sigmoid_gate(x[rows].contiguous(), qkv[rows], heads, dim))

    batched = ops(slice(0, tokens))
    for row in (0, 151, 299):
        assert all(torch.equal(alone[0], every[row]) for alone, every in zip(ops(slice(row, row + 1)), batched))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert all(torch.equal(a, b) for a, b in zip(ops(slice(0, tokens)), batched))
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    gated_norm, qk_heads, sigmoid_gate = hybrid_ops()
    with pytest.raises(RuntimeError, match="gated_norm: x"):
        gated_norm(torch.zeros(6, 8), torch.zeros(2, 16), torch.zeros(8), 1e-6)
    with pytest.raises(RuntimeError, match="qk_heads: shapes"):
        qk_heads(torch.zeros(2, 32), 2, 1, 8, torch.zeros(8), torch.zeros(8), 1e-6, 1e-6, torch.zeros(2, 4),
                 torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="sigmoid_gate: x"):
        sigmoid_gate(torch.zeros(2, 15), torch.zeros(2, 64), 2, 8)
