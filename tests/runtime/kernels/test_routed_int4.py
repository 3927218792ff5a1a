"""A routed block over int4 experts in ponder's own arithmetic (routed_int4.cpp): its routing close to
transformers' softmax-first top-k, its experts' sum exactly the int4 kernel's rows weighted and added in
ascending expert order, the whole block exactly its routing then its sum, each row's bits its own
whatever the batch and the threads."""

import pytest
import torch

from runtime.kernels.cpu_kernels import q4_unavailable, routed_ops, small_ops

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="ponder's CPU kernels need an x86-64 CPU with AVX2")

HIDDEN, INNER, EXPERTS, TOP_K = 64, 96, 6, 3  # (three experts a row: their order of addition shows)


@pytest.fixture(scope="module")
def block():
    from runtime.model.experts import int4_tensors
    from runtime.model.float_layers import FloatLinear
    from runtime.model.quantize import Int4Linear

    generator = torch.Generator().manual_seed(11)
    gate_up = [Int4Linear.from_weight(torch.randn(2 * INNER, HIDDEN, generator=generator)) for _ in range(EXPERTS)]
    down = [Int4Linear.from_weight(torch.randn(HIDDEN, INNER, generator=generator) / 8) for _ in range(EXPERTS)]
    router = FloatLinear.from_weight(torch.randn(EXPERTS, HIDDEN, generator=generator))
    return gate_up, down, router, int4_tensors(gate_up, down)


def rows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed))


def whole(block, x, norm_weight=None, residual=False, norm_topk_prob=True):
    routed_int4, _, _ = routed_ops()
    _, _, router, tensors = block
    return routed_int4(x, norm_weight, 1e-6, router.weight, tensors, TOP_K, norm_topk_prob, 2 * INNER, HIDDEN, -1,
                       residual)


@pytest.mark.parametrize("renormalise", [True, False])
def test_routing_is_softmax_then_top_k(renormalise):
    _, route_rows, _ = routed_ops()
    logits = torch.randn(50, 10, generator=torch.Generator().manual_seed(1)) * 4
    weights, indices = route_rows(logits, 3, renormalise)
    probs = torch.softmax(logits.double(), dim=-1)
    top, expected = torch.topk(probs, 3, dim=-1)
    if renormalise:
        top = top / top.sum(-1, keepdim=True)
    assert weights.dtype == torch.float32 and torch.equal(indices, expected)
    torch.testing.assert_close(weights.double(), top, rtol=2e-6, atol=1e-30)
    # equal probabilities: the lower expert first; a 13-expert row runs the exponential's tail too
    weights, indices = route_rows(torch.zeros(1, 13), 4, renormalise)
    assert indices.tolist() == [[0, 1, 2, 3]]
    torch.testing.assert_close(weights, torch.full((1, 4), 0.25 if renormalise else 1 / 13))


def test_the_experts_sum_is_each_expert_s_rows_weighted_in_ascending_expert_order(block):
    _, route_rows, mix_int4 = routed_ops()
    _, silu_mul = small_ops()
    gate_up, down, router, tensors = block
    x = rows(7)
    weights, indices = route_rows(router.rows(x), TOP_K, True)
    assert len(indices.unique()) > TOP_K
    out = mix_int4(x, indices, weights, tensors, 2 * INNER, HIDDEN)
    expected = torch.zeros_like(x)
    for e in range(EXPERTS):
        for t, j in (indices == e).nonzero().tolist():
            h = down[e].rows(silu_mul(gate_up[e].rows(x[t:t + 1]), INNER))[0]
            expected[t] = expected[t] + weights[t, j] * h
    assert torch.equal(out, expected)


def test_the_block_is_its_routing_then_its_sum(block):
    _, route_rows, mix_int4 = routed_ops()
    _, _, router, tensors = block
    x = rows(9, 2)
    routed = whole(block, x)
    weights, indices = route_rows(router.rows(x), TOP_K, True)
    assert torch.equal(routed, mix_int4(x, indices, weights, tensors, 2 * INNER, HIDDEN))
    assert not torch.equal(whole(block, x, norm_topk_prob=False), routed)
    # the residual: x added after; the norm: RMS norm's arithmetic before (close to torch's, own bits)
    norm_weight = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))
    normed = whole(block, x, norm_weight)
    assert torch.equal(whole(block, x, norm_weight, residual=True), x + normed)
    torch_normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    torch.testing.assert_close(normed, whole(block, torch_normed), rtol=0, atol=0.05 * normed.abs().max().item())
    assert not torch.allclose(normed, routed, atol=1e-3)


def test_a_row_alone_has_the_bits_it_has_in_a_batch(block):
    norm_weight = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(4))
    x = rows(40, 5)
    crowd = whole(block, x, norm_weight, residual=True)
    for row in (0, 17, 39):
        assert torch.equal(whole(block, x[row:row + 1], norm_weight, residual=True)[0], crowd[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(whole(block, x, norm_weight, residual=True), crowd)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_refused(block):
    routed_int4, route_rows, mix_int4 = routed_ops()
    _, _, router, tensors = block
    with pytest.raises(RuntimeError, match="route_rows: top_k 7 of 6 experts"):
        route_rows(torch.zeros(2, 6), 7, True)
    with pytest.raises(RuntimeError, match="routed_int4: experts must hold 6 tensors an expert"):
        routed_int4(rows(1), None, 1e-6, router.weight, tensors[:-6], TOP_K, True, 2 * INNER, HIDDEN, -1, False)
    with pytest.raises(RuntimeError, match="routed_int4: no expert 6"):
        mix_int4(rows(1), torch.tensor([[0, 1, 6]]), torch.ones(1, 3), tensors, 2 * INNER, HIDDEN)
