"""A second start of the server, on the same disk tier, reports the prefix hit of the first."""

import httpx

from tests.server.live import live_server

MESSAGES = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]


def test_prefix_cache_survives_a_server_restart(tiny_llama, tmp_path):
    env = {"PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_CACHE__NUM_BLOCKS": "256",
           "PONDER_CACHE__DISK_DIR": str(tmp_path / "kv")}
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        first = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        second = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (first["usage"]["prompt_tokens"] - 1) // 4 * 4
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
