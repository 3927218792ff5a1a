"""Checks that need a CUDA GPU: `make test-gpu` (pytest -m cuda) runs them on one.

Each test runs on the device named by PONDER_TEST_DEVICE (default cuda) and is skipped where that
device is missing. The same tests run on the CPU with PONDER_TEST_DEVICE=cpu, which checks their
logic but not the GPU's behaviour: pinned memory, the copy stream and cuBLAS's kernel choice only
show on a GPU.
"""

from __future__ import annotations

import math
import os
import time

import httpx
import pytest
import torch

from runtime.wire.params import SamplingParams
from runtime.wire.protocol import Delta
from runtime.model.row_padding import RowPadding
from runtime.model.sampler import SamplingState, sample
from storage.host_tier import HostTier
from storage.kv_cache import KVCache, KVShape
from storage.tiers import TierChain, TransferEngine
from tests.runtime.engine_helpers import engine_for, request, run
from tests.server.live import live_server, metric

DEVICE = torch.device(os.environ.get("PONDER_TEST_DEVICE", "cuda"))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"),
]


# -- sampling -------------------------------------------------------------------------------------
def draw(logits: torch.Tensor, seeds: list[int], temperature: float = 1.0) -> list[int]:
    params = SamplingParams(temperature=temperature)
    states = [SamplingState(params, seed, DEVICE) for seed in seeds]
    return [out.token_id for out in sample(logits, states, [([], [])] * len(seeds))]


def test_seeded_sampling_repeats_and_ignores_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 500, device=DEVICE) * 3
    together = draw(logits, [11, 12, 13, 14, 15, 16])
    assert together == draw(logits, [11, 12, 13, 14, 15, 16])
    alone = [draw(logits[i:i + 1], [seed])[0] for i, seed in enumerate([11, 12, 13, 14, 15, 16])]
    assert alone == together
    reordered = draw(logits[[5, 4, 3, 2, 1, 0]], [16, 15, 14, 13, 12, 11])
    assert reordered == together[::-1]


def test_sampled_tokens_follow_the_distribution():
    """Frequencies over 4000 seeds match the softmax: a check that needs no CPU reference draw."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = probs.log().to(DEVICE).expand(4000, -1).contiguous()
    tokens = draw(logits, list(range(4000)))
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double()
    expected = probs.double() * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # 4 degrees of freedom: p < 0.001 for a correct sampler


def test_greedy_rows_take_the_argmax_and_logprobs_come_back():
    logits = torch.randn(3, 50, device=DEVICE)
    states = [SamplingState(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), 0, DEVICE)] * 3
    outs = sample(logits, states, [([], [])] * 3)
    assert [o.token_id for o in outs] == logits.argmax(-1).tolist()
    reference = torch.log_softmax(logits.double(), -1)
    for row, out in enumerate(outs):
        assert math.isclose(out.logprob, float(reference[row, out.token_id]), abs_tol=1e-4)
        assert [t for t, _ in out.top] == reference[row].topk(2).indices.tolist()


# -- attention: decode against prefill ------------------------------------------------------------
# Decode attends over the paged cache one query at a time; prefill uses SDPA. In low precision the
# two differ by rounding; scores and softmax in float32 keep that to these bounds on the chosen
# token's log-probability (tiny model, sharpened head).
TOLERANCE = {torch.bfloat16: 0.25, torch.float16: 0.05}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_agrees_with_a_full_prefill_in_low_precision(tiny_llama, dtype):
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import runs_natively

    if not runs_natively(dtype, DEVICE):  # a CPU without it: ponder refuses the dtype at start-up
        pytest.skip(f"{dtype} is not native on this {DEVICE.type}")
    name = str(dtype).removeprefix("torch.")
    engine = engine_for(tiny_llama, device=DEVICE.type, dtype=name)
    prompt = [1] + list(range(5, 40))
    engine.add_request(request("a", prompt, max_tokens=24, logprobs=True))
    tokens, served = [], []
    while engine.has_work:
        for message in engine.step():
            if isinstance(message, Delta):
                tokens.extend(message.token_ids)
                served.extend(lp.logprob for lp in message.logprobs or ())
    assert len(tokens) == len(served) == 24
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype, attn_implementation="sdpa").to(DEVICE)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=DEVICE)).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    chosen = reference[torch.arange(len(tokens)), torch.tensor(tokens, device=DEVICE)]
    top = reference.max(-1).values
    # Every served token is the prefill's choice, or within the tolerance of it.
    assert float((top - chosen).max()) <= TOLERANCE[dtype]
    assert max(abs(a - float(b)) for a, b in zip(served, chosen)) <= TOLERANCE[dtype]


# -- tiers through pinned memory on the copy stream ------------------------------------------------
def test_tier_round_trip_through_pinned_memory_keeps_every_byte():
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    cache = KVCache(shape, 4, torch.float16, DEVICE)
    cache.kv.copy_(torch.randn(cache.kv.shape, device=DEVICE).to(torch.float16))
    original = cache.kv.clone()
    host = HostTier(shape.block_shape, torch.float16, 8 * cache.bytes_per_block, pin_memory=True)
    assert host.is_pinned == (DEVICE.type == "cuda")
    chain = TierChain(host, None, compute_name="gpu")
    transfers = TransferEngine(chain, device=DEVICE)
    names = [bytes([i]) * 16 for i in range(4)]
    for i, name in enumerate(names):
        transfers.offload(name, cache.kv[i])
    cache.kv.zero_()  # ordered after the copies out: they must have read the old contents
    transfers.close()
    transfers = TransferEngine(chain, device=DEVICE)
    handle = transfers.prefetch(names[::-1], out={name: cache.kv[3 - i] for i, name in enumerate(names)})
    for name in names:
        assert handle.wait(name) is not None
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(cache.kv, original.flip(0))
    assert chain.bytes_moved["gpu/cpu"] == chain.bytes_moved["cpu/gpu"] == 4 * cache.bytes_per_block
    transfers.close()


def test_write_block_may_reuse_its_source_at_once():
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    cache = KVCache(shape, 2, torch.float16, DEVICE)
    source = torch.empty(shape.block_shape, dtype=torch.float16, pin_memory=DEVICE.type == "cuda")
    for value in (1.0, 2.0):
        source.fill_(value)
        cache.write_block(int(value) - 1, source)
    source.fill_(7.0)  # a host slab slot reused right away must not reach the blocks
    staged = cache.staging_block().fill_(3.0)
    cache.write_block(0, staged, is_private=True)
    assert cache.kv[0].eq(3.0).all() and cache.kv[1].eq(2.0).all()


# -- batch invariance ------------------------------------------------------------------------------
def test_padded_row_counts_give_every_row_the_bits_of_the_largest_call(tiny_llama):
    """Every step size up to 320 rows pads to the smallest count the probe saw agree, and at that
    count each layer the lean decoder runs (fused q/k/v and gate/up included) gives the step's rows
    the bits of one 320-row call: what a BLAS's choice of kernel by shape could break."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from runtime.model.row_padding import BUCKET_ROWS, SMALL_ROWS, executed_linears

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).to(DEVICE)
    padding = RowPadding.probe(model, max_rows=320, max_model_len=64, block_size=4)
    safe = padding.safe_counts
    assert safe[-1] == 320 and all(c <= SMALL_ROWS or c % BUCKET_ROWS == 0 for c in safe)
    layers = executed_linears(model)
    assert sorted(tuple(layer.weight.shape) for layer in layers)[-1] == (256, 64)  # gate/up, fused
    generator = torch.Generator().manual_seed(5)
    for layer in layers:
        x = torch.randn(320, layer.in_features, generator=generator).to(DEVICE)
        reference = F.linear(x, layer.weight, layer.bias)
        for rows in range(1, 321):
            padded = padding.pad(rows)
            assert padded == next(c for c in safe if c >= rows)
            assert torch.equal(F.linear(x[:padded], layer.weight, layer.bias)[:rows], reference[:rows]), \
                f"{tuple(layer.weight.shape)}: {rows} rows padded to {padded}"


def test_a_sequence_decodes_to_the_same_bits_alone_or_beside_others(tiny_llama):
    engine = engine_for(tiny_llama, device=DEVICE.type, batch_invariant=True)
    prompt = [1] + list(range(5, 20))
    alone = run(engine, [request("alone", prompt, max_tokens=16, temperature=1.0, seed=3, logprobs=True)])
    crowd = [request("crowd", prompt, max_tokens=16, temperature=1.0, seed=3, logprobs=True)] + [
        request(f"other{i}", [1] + [7 + i] * (5 + 3 * i), max_tokens=20, temperature=1.0, seed=i) for i in range(6)]
    beside = run(engine, crowd)
    assert beside["crowd"]["choices"] == alone["alone"]["choices"]


def test_a_seeded_search_gives_the_same_answer_alone_in_a_crowd_and_speculating(tiny_llama):
    """The issue's promise on the device: a seeded beam search (sampled children, confidence-scored steps)
    gives the same paths, scores and answers alone, beside other traffic, and with speculative extension."""
    import msgspec

    from runtime.wire.params import SamplingParams, SearchParams
    from runtime.wire.protocol import GenerateRequest
    from tests.runtime.search.test_search_engine import run_search

    def outcome(messages):
        texts, finals = {}, {}
        for m in messages:
            if isinstance(m, Delta) and m.request_id == "s":
                texts[m.index] = texts.get(m.index, ()) + tuple(m.token_ids)
                if m.search is not None:
                    finals[m.index] = (m.search.score, tuple(m.search.step_scores), m.search.answer)
        return texts, finals

    req = GenerateRequest(request_id="s", endpoint="chat", messages=({"role": "user", "content": "w1 w2 w3"},),
                          sampling=SamplingParams(max_tokens=24, temperature=1.0, seed=11, n=2),
                          search=SearchParams(strategy="beam", n=8, beam_width=4, max_steps=4, max_step_tokens=5,
                                              verifier="confidence", greedy_anchor=False))
    alone = outcome(run_search(engine_for(tiny_llama, device=DEVICE.type, batch_invariant=True, num_blocks=1024), req))
    assert alone[0] and alone[1]
    speculating = engine_for(tiny_llama, device=DEVICE.type, batch_invariant=True, num_blocks=1024,
                             speculative_extension=True)
    assert outcome(run_search(speculating, req)) == alone
    crowded = engine_for(tiny_llama, device=DEVICE.type, batch_invariant=True, num_blocks=1024)
    crowded.add_request(msgspec.structs.replace(req, request_id="t", sampling=msgspec.structs.replace(req.sampling, seed=12)))
    crowded.add_request(request("p", [1] + list(range(5, 30)), max_tokens=20, temperature=1.0, seed=5))
    assert outcome(run_search(crowded, req)) == alone


# -- one served request, plain and with search -----------------------------------------------------
def test_a_served_request_end_to_end_plain_and_with_search(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "1024", "PONDER_CACHE__BLOCK_SIZE": "4"}
    with live_server("--model", str(tiny_llama), "--device", DEVICE.type, env=env) as (base, _):
        body = {"model": "x", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 8, "seed": 1}
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        plain = httpx.post(base + "/v1/chat/completions", json={**body, "model": model}, timeout=120)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 8 or plain.json()["choices"][0]["finish_reason"] == "stop"
        search = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 3, "max_step_tokens": 4,
                  "verifier": "confidence"}
        found = httpx.post(base + "/v1/chat/completions", json={**body, "model": model, "search": search},
                           timeout=300)
        assert found.status_code == 200, found.text
        assert found.json()["search"]["paths_explored"] >= 4
        assert f'device="{DEVICE.type}' in httpx.get(base + "/metrics").text


# -- served searches scored by a model: the judge (the generator itself) and a PRM of its own ------
@pytest.fixture(scope="module")
def qwen_prm_dir(tmp_path_factory):
    """A tiny replica of Qwen/Qwen2.5-Math-PRM-7B in its published layout (tests/replicas/verifiers.py):
    a qwen2 body, the two-layer `score` head, `<extra_0>` steps, bf16 shards."""
    from tests.replicas.verifiers import write_verifier

    return write_verifier("qwen-prm", tmp_path_factory.mktemp("qwen-prm"))


@pytest.fixture(scope="module")
def search_server(tiny_llama, qwen_prm_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "ponder.toml"
    config.write_text(f'[verifiers.prm]\nkind = "qwen-prm"\npath = "{qwen_prm_dir}"\n')
    env = {"PONDER_CACHE__NUM_BLOCKS": "1024", "PONDER_CACHE__BLOCK_SIZE": "4"}
    with live_server("--model", str(tiny_llama), "--device", DEVICE.type, "--config", str(config), env=env) as (base, _):
        yield base


@pytest.mark.parametrize("verifier", ["judge", "prm"])
def test_a_served_search_scored_by_a_model_end_to_end(search_server, verifier):
    """A beam search whose every step is scored by the judge (the generator asked Yes/No about the
    step) or by a process reward model (the Qwen PRM replica) with its own KV store, through the HTTP
    API on the device."""
    base = search_server
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    search = {"strategy": "beam", "n": 4, "beam_width": 2, "max_steps": 3, "max_step_tokens": 4,
              "verifier": verifier}
    body = {"model": model, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 12, "seed": 1,
            "temperature": 1.0, "n": 2, "search": search}
    found = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert found.status_code == 200, found.text
    answer = found.json()
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:
        assert 0.0 <= choice["search"]["score"] <= 1.0 and choice["search"]["step_scores"]
    summary = answer["search"]
    assert summary["strategy"] == "beam" and summary["paths_explored"] >= 4
    assert summary["verifier_calls"] > 0 and summary["verifier_tokens_prefilled"] > 0
    # Each path's steps were scored: one score a verified step, the aggregate (last) its final one.
    for choice in answer["choices"]:
        assert choice["search"]["score"] == choice["search"]["step_scores"][-1]
    deadline = time.monotonic() + 10  # the runtime's statistics arrive every 0.2 s (live_server)
    while metric(base, "ponder_verifier_seconds_count") < summary["verifier_calls"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(base, "ponder_verifier_seconds_count") >= summary["verifier_calls"]
