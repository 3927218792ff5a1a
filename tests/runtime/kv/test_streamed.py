"""`kv_granularity = "head"`: a lone request whose KV is 4x the compute pool streams (layer, KV-head
group) pieces through it from the host and disk tiers, with the tokens of a resident run and of
transformers' generate; one that even the tiers cannot hold is refused, saying what would fit.

The model has 8 layers: each (layer, KV head) slice streams its whole context through two staging
buffers in the compute tier, so a tier of B blocks streams about 8 layers * 2 heads / 2 * B blocks.
"""

import pytest
from transformers import AutoModelForCausalLM

from runtime.model.loader import SettingError
from runtime.wire.protocol import RequestError
from tests.conftest import build_model
from tests.runtime.engine_helpers import engine_for as _engine_for, hf_greedy, request, run

PROMPT = [5 + (i * 7) % 60 for i in range(100)]
NEW = 28  # 128 tokens of KV: 32 blocks of 4, four times the 8-block compute pool


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("deep-llama"), "llama", layers=8)


def engine_for(path, **options):
    return _engine_for(path, max_model_len=160, **options)


@pytest.fixture(scope="module")
def resident(deep_llama):
    return run(engine_for(deep_llama, num_blocks=64), [request("r", PROMPT, max_tokens=NEW)])["r"]["choices"][0]


def test_a_request_four_times_the_pool_streams_with_the_resident_tokens(deep_llama, resident):
    engine = engine_for(deep_llama, num_blocks=8, kv_granularity="head", host_kv_memory_bytes=1 << 20,
                        max_num_batched_tokens=32)
    assert engine.kv.num_blocks_for(len(PROMPT) + NEW) == 4 * engine.pool.num_blocks
    got = run(engine, [request("s", PROMPT, max_tokens=NEW)])["s"]["choices"][0]
    hf = AutoModelForCausalLM.from_pretrained(deep_llama).eval()
    assert got == resident == hf_greedy(hf, PROMPT, NEW)
    moved = engine.runtime_stats().kv_transfer_bytes
    assert moved["host/cpu"] > 0 and moved["cpu/host"] > 0
    assert engine.streamed.seq is None and engine.pool.num_used == 0


def test_pieces_from_the_disk_tier_and_a_corrupt_one_rebuilt(deep_llama, resident, tmp_path, caplog):
    engine = engine_for(deep_llama, num_blocks=8, kv_granularity="head", disk_kv_dir=str(tmp_path),
                        disk_kv_bytes=1 << 20, max_num_batched_tokens=32)
    assert engine.add_request(request("d", PROMPT, max_tokens=NEW))[0].prompt_tokens == len(PROMPT)
    tokens, corrupted = [], False
    while engine.has_work:
        for message in engine.step():
            tokens += getattr(message, "token_ids", ())
        streamed = engine.streamed
        if not corrupted and streamed.store is not None and len(tokens) > 4:
            disk = streamed.store.pipeline.chain.disk
            disk.flush()
            for path in disk.path.glob("*.kvg"):  # every piece written so far fails its checksum
                data = bytearray(path.read_bytes())
                for i in range(0, len(data), streamed.piece_bytes):
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))
            disk._reuse.clear()
            corrupted = True
    assert corrupted and "checksum mismatch" in caplog.text and engine.streamed.num_rebuilt > 0
    assert tokens == resident


def test_a_request_the_tiers_cannot_hold_is_refused_with_what_fits(deep_llama):
    engine = engine_for(deep_llama, num_blocks=8, kv_granularity="head", host_kv_memory_bytes=16 << 10)
    fit = engine.streamed.max_tokens() + 1
    assert 32 < fit < 128
    (out,) = engine.add_request(request("big", PROMPT, max_tokens=NEW))
    assert isinstance(out, RequestError) and out.status == 400 and out.param == "max_tokens"
    assert f"hold at most {fit} tokens" in out.message
    ok = engine.add_request(request("fits", PROMPT[:fit - 8], max_tokens=8))
    assert not isinstance(ok[0], RequestError)
    block = engine_for(deep_llama, num_blocks=8, host_kv_memory_bytes=1 << 20)
    (out,) = block.add_request(request("big", PROMPT, max_tokens=NEW))
    assert isinstance(out, RequestError) and "more than the 32 this server holds" in out.message


def test_bad_granularity_or_budget_stops_start_up(deep_llama):
    with pytest.raises(SettingError, match="^scheduler.kv_granularity = 'layer' is not one of block, head$"):
        engine_for(deep_llama, kv_granularity="layer")
    with pytest.raises(SettingError, match="^scheduler.kv_granularity = head: a compute budget of 2 blocks"):
        engine_for(deep_llama, num_blocks=2, kv_granularity="head")


def test_the_start_up_check_names_the_budget_setting(deep_llama):
    from runtime.preflight import check
    from runtime.wire.options import RuntimeOptions

    check(RuntimeOptions(model=str(deep_llama), device="cpu", block_size=4, num_blocks=8, max_model_len=160, kv_granularity="head"))
    with pytest.raises(SettingError, match=r"^scheduler\.kv_granularity = head: a compute budget of 8 blocks cannot "
                                           r"stream one sequence of max_model_len 512 tokens: "):
        check(RuntimeOptions(model=str(deep_llama), device="cpu", block_size=4, num_blocks=8, kv_granularity="head"))
    with pytest.raises(SettingError, match=r"^cache\.num_blocks = 1: one path needs at least 2 blocks"):
        check(RuntimeOptions(model=str(deep_llama), device="cpu", block_size=4, num_blocks=1, scheduler_policy="token"))
    with pytest.raises(SettingError, match=r"^scheduler\.kv_granularity = 'layers' is not one of block, head$"):
        check(RuntimeOptions(model=str(deep_llama), device="cpu", block_size=4, kv_granularity="layers"))
