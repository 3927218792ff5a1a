"""The GPU path compiled for a CUDA GPU (`make test-gpu`): ponder's Triton kernels, the Triton layer loop
and CUDA graph replay. Their CPU twins run in Triton's interpreter in `make test` (tests/runtime/gpu_path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.runtime.engine_helpers import engine_for, request, run

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICE = torch.device("cuda")


def test_decode_attention_gives_a_query_the_same_bits_alone_and_in_a_batch():
    from runtime.kernels.gpu.paged import decode_attention

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(40, 2, 2, 4, 16, 64, generator=gen).to(DEVICE, torch.bfloat16)
    queries = torch.randn(32, 16, 64, generator=gen).to(DEVICE, torch.bfloat16)
    tables = torch.randint(0, 40, (32, 8), generator=gen).to(DEVICE)
    ctx = torch.randint(1, 129, (32,), generator=gen).to(DEVICE)
    rows = torch.arange(32, device=DEVICE)
    batch = torch.zeros(32, 16, 64, dtype=torch.bfloat16, device=DEVICE)
    decode_attention(queries, rows, kv, tables, ctx, 1, 0.125, batch)
    for i in (0, 7, 31):
        alone = torch.zeros(1, 16, 64, dtype=torch.bfloat16, device=DEVICE)
        decode_attention(queries[i:i + 1], rows[:1], kv, tables[i:i + 1], ctx[i:i + 1], 1, 0.125, alone)
        assert torch.equal(alone[0], batch[i])
    # against float64 attention over the query's own blocks
    i, n = 7, int(ctx[7])
    keys = kv[tables[i], 1, 0].permute(1, 0, 2, 3).reshape(4, -1, 64)[:, :n].double()
    values = kv[tables[i], 1, 1].permute(1, 0, 2, 3).reshape(4, -1, 64)[:, :n].double()
    q = queries[i].double().view(4, 4, 64)
    weights = torch.softmax(torch.einsum("hrd,htd->hrt", q, keys) * 0.125, -1)
    expected = torch.einsum("hrt,htd->hrd", weights, values).reshape(16, 64)
    torch.testing.assert_close(batch[i].double(), expected, atol=0.02, rtol=0.02)


def test_the_elementwise_kernels_stay_within_a_rounding_of_torch():
    from runtime.kernels.gpu.elementwise import act_mul, rms_norm

    gen = torch.Generator().manual_seed(1)
    x, res = (torch.randn(9, 576, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(DEVICE, torch.bfloat16)
    out, summed = rms_norm(x, weight, 1e-5, residual=res)
    assert torch.equal(summed, x + res)
    wide = summed.float()
    expected = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(out, expected, atol=0.07, rtol=0.016)
    gate_up = torch.randn(9, 2 * 1536, generator=gen).to(DEVICE, torch.bfloat16)
    torch.testing.assert_close(act_mul(gate_up, 1536), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:],
                               atol=0.03, rtol=0.016)


# (the default tile; the inputs split four ways; tensor-core tiles of 16 rows, one split four ways; int8
# inputs' GEMV and tensor-core tile)
@pytest.mark.parametrize("tile", [None, (8, 128, 4, 4), (64, 128, 4, 1, 16), (32, 128, 4, 4, 16), (16, 256, 4, 1, 1, 1),
                                  (64, 128, 4, 1, 16, 1)])
def test_the_block_gemm_keeps_each_row_s_bits(tile):
    from runtime.kernels.gpu.linear import block_linear, pack_nibbles

    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (96, 512), generator=gen, dtype=torch.uint8).to(DEVICE)
    d, m = torch.rand(96, 16, generator=gen).to(DEVICE), torch.randn(96, 16, generator=gen).to(DEVICE)
    x = torch.randn(40, 512, generator=gen).to(DEVICE, torch.bfloat16)
    batch = block_linear(x, codes, d, m, tile=tile)
    for count in (1, 5, 17):
        assert torch.equal(block_linear(x[:count], codes, d, m, tile=tile), batch[:count])
    packed = pack_nibbles(codes)  # two codes a byte: the same arithmetic, the same bits
    assert torch.equal(block_linear(x, packed, d, m, packed=True, tile=tile), batch)
    dense = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
    torch.testing.assert_close(batch.float(), x.float() @ dense.T, atol=0.5, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_inputs_give_the_gemv_and_the_tensor_cores_the_same_bits(dtype):
    """On the GPU's integer tensor cores as on its CUDA cores: the tiles of one sum order give a row the same
    bits (so a stream alone may take the GEMV and a search's beams the tile), Q4_K's scales as held."""
    from runtime.kernels.gpu.linear import TILES, block_linear, pack_nibbles, sum_order, unpack

    gen = torch.Generator().manual_seed(5)
    codes = pack_nibbles(torch.randint(0, 16, (160, 1024), generator=gen, dtype=torch.uint8)).to(DEVICE)
    d = torch.randint(1, 64, (160, 32), generator=gen, dtype=torch.int8).to(DEVICE)
    supers = (torch.rand(160, 4, generator=gen).to(DEVICE) * 1e-3, torch.rand(160, 4, generator=gen).to(DEVICE) * 1e-2)
    x = torch.randn(40, 1024, generator=gen).to(DEVICE, dtype)
    by_order = {}
    for tile in [tile for tile in TILES if unpack(tile)[5]]:
        out = block_linear(x, codes, d, -(d // 2), packed=True, tile=tile, supers=supers)
        assert torch.equal(block_linear(x[:1], codes, d, -(d // 2), packed=True, tile=tile, supers=supers), out[:1])
        assert torch.equal(by_order.setdefault(sum_order(tile, 1024), out), out), tile
    assert len(by_order) == 2  # (no split; four of 256 inputs)


@pytest.fixture
def fixture_value(request):
    return request.getfixturevalue


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.runtime.model.test_decoder_gemma3 import write_gemma3

    return write_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


# (Qwen3: head norms in the attention inputs; Gemma 3: its norms, GELU, two rotaries, its sliding layers' cache)
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_the_triton_loop_gives_the_torch_loop_s_tokens_in_float32(fixture_value, model):
    path = fixture_value(model)
    requests = lambda: [request("greedy", [1, 5, 6, 7, 8, 9], max_tokens=12),  # noqa: E731
                        request("sampled", [1, 40, 41], max_tokens=12, temperature=0.8, seed=3, n=3)]
    triton_engine = engine_for(path, device="cuda", dtype="float32")
    assert triton_engine.runner.gpu_kernels and triton_engine.runner.decoder.gpu is not None
    expected = run(triton_engine, requests())
    torch_engine = engine_for(path, device="cuda", dtype="float32")
    torch_engine.runner.graphs = None
    torch_engine.runner.gpu_kernels = False
    torch_engine.runner.attention_kernel = None  # decode attention in torch's batched matmuls
    torch_engine.runner.decoder.gpu = None  # (after the Triton run: a loaded model may be shared)
    assert run(torch_engine, requests()) == expected


def test_graph_replay_gives_the_eager_steps_bits(tiny_llama):
    requests = lambda: [request("a", [1, 5, 6, 7], max_tokens=20, temperature=1.0, seed=1, logprobs=True),  # noqa: E731
                        request("b", [1, 9] * 5, max_tokens=14, temperature=0.7, seed=2, n=4, logprobs=True)]
    graphed = engine_for(tiny_llama, device="cuda", dtype="bfloat16")
    assert graphed.runner.graphs is not None and graphed.runner.graphs.graphs
    replays = []
    run_graphs = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda scheduled: replays.append(len(scheduled)) or run_graphs(scheduled)
    eager = engine_for(tiny_llama, device="cuda", dtype="bfloat16")
    eager.runner.graphs = None
    assert run(graphed, requests()) == run(eager, requests())
    assert replays and max(replays) == 5


def test_the_gated_delta_kernel_gives_the_torch_loop_s_tokens(tmp_path_factory, monkeypatch):
    """Qwen3.5's recurrent layers in the Triton twin of the CPU kernel, compiled for the GPU: the token
    loop's greedy and seeded tokens in float32 (a prompt over several blocks, two sampled paths)."""
    import runtime.model.recurrent as recurrent
    from runtime.kernels.gpu.gated_delta import gated_delta_steps
    from tests.replicas.hybrid import write_qwen35

    directory = write_qwen35(tmp_path_factory.mktemp("qwen35"))
    prompt = [5 + (11 * i) % 90 for i in range(23)]
    requests = lambda: [request("greedy", prompt, max_tokens=10),  # noqa: E731
                        request("sampled", prompt[:9], max_tokens=10, temperature=0.8, seed=3, n=2)]
    triton_engine = engine_for(directory, device="cuda", dtype="float32")
    assert triton_engine.runner.recurrent.layers[0].forward.args[0].kernel is gated_delta_steps
    expected = run(triton_engine, requests())
    monkeypatch.setattr(recurrent, "_kernel_for", lambda layer: None)
    torch_engine = engine_for(directory, device="cuda", dtype="float32")
    assert torch_engine.runner.recurrent.layers[0].forward.args[0].kernel is None
    assert run(torch_engine, requests()) == expected


def test_start_up_times_the_block_tiles_and_each_chosen_one_keeps_a_row_s_bits(tmp_path, monkeypatch):
    """runtime.model.gpu_tiles on a GPU with its real clock: a tile for every launched block layer shape,
    set for the kernel, each keeping a row's bits alone and among 40 rows."""
    from runtime.kernels.gpu import linear
    from runtime.model import gpu_tiles
    from runtime.model.cached_model import gguf_config
    from runtime.model.decoders import build_decoder
    from runtime.model.gguf_load import load_gguf_blocks
    from runtime.model.loader import resolve_model
    from tests.gguf_model import write_tiny_gguf

    monkeypatch.setattr(linear, "CHOSEN", {})
    source = resolve_model(str(write_tiny_gguf(tmp_path, "Q4_K", hidden=256, ffn=512)))
    model, _ = load_gguf_blocks(source, gguf_config(source), torch.bfloat16, "sdpa", device=DEVICE)
    decoder = build_decoder(model)
    tiles = (linear.TILE, (8, 512, 4, 2), (64, 128, 4, 1, 16), (32, 256, 4, 4, 16), (16, 256, 4, 1, 1, 1),
             (64, 128, 4, 1, 16, 1))  # (each compiles a shape: few)
    chosen = gpu_tiles.tune(model, decoder, torch.bfloat16, tiles=tiles, root=tmp_path / "cache")
    layers = gpu_tiles.launched_layers(model, decoder)
    assert set(chosen) == {gpu_tiles.key_of(layer) for layer in layers} and linear.CHOSEN == chosen
    assert {tile for steps in chosen.values() for _, tile in steps} <= set(tiles)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    for layer in layers:
        if layer.in_features == 256:
            batch = layer.rows(x)
            assert all(torch.equal(layer.rows(x[:count]), batch[:count]) for count in (1, 5, 17))


@pytest.mark.parametrize("tile", [None, (64, 128, 4, 1, 16)])
def test_a_down_projection_s_act_as_it_loads_is_the_elementwise_launch_s_bits(tile):
    from runtime.kernels.gpu.elementwise import act_mul
    from runtime.kernels.gpu.linear import block_linear

    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (96, 256), generator=gen, dtype=torch.uint8).to(DEVICE)
    d, m = torch.rand(96, 16, generator=gen).to(DEVICE) * 0.01, torch.randn(96, 16, generator=gen).to(DEVICE) * 0.01
    gate_up = (torch.randn(20, 1024, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    for act, gelu in ((1, False), (2, True)):
        apart = block_linear(act_mul(gate_up, 512, gelu=gelu), codes, d, m, packed=True, tile=tile)
        assert torch.equal(block_linear(gate_up, codes, d, m, packed=True, tile=tile, act=act), apart), gelu
