"""`ponder bench headwise` drives the served engine with a request four times larger than its
compute pool: either the engine serves it with the resident run's tokens, or it refuses it and the
benchmark stops saying so (it never reports a result it did not measure)."""

from __future__ import annotations

import json

import pytest

from bench import headwise


def test_a_request_four_times_the_pool_is_served_identically_or_refused_plainly(tiny_llama, tmp_path):
    path = tmp_path / "headwise.json"
    args = ["--model", str(tiny_llama), "--prompt", "60", "--tokens", "4", "--block-size", "4",
            "--threads", "1", "--disk-dir", str(tmp_path), "--json", str(path)]
    try:
        headwise.main(args)
    except SystemExit as stop:
        message = str(stop.code)
        assert message.startswith("head-wise offload is not served by this engine: a request of 16 blocks "
                                  "(60 prompt + 4 new tokens) over a 4-block compute pool was refused (400: ")
        assert not path.exists()
        pytest.skip(f"this engine has no head-wise offload: {message}")
    r = json.loads(path.read_text())
    assert r["request_blocks"] == 16 and r["pool_blocks"] == 4
    assert r["outputs_identical"] is True and len(r["tokens"]) == 4
    assert r["offloaded"]["bytes_into_compute"] > 0 and r["resident"]["bytes_into_compute"] == 0
    assert 0 <= r["offloaded"]["stall_share"] <= 1
