"""`ponder bench headwise` drives the served engine with a request four times larger than its
compute pool: the engine serves it head-wise with the resident run's tokens."""

from __future__ import annotations

import json

import pytest

from bench import headwise
from tests.conftest import build_model


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """Eight layers: a compute pool of a quarter of the request streams one (layer, KV head) slice's
    whole context through its two staging buffers."""
    return build_model(tmp_path_factory.mktemp("deep-llama"), "llama", layers=8)


def test_a_request_four_times_the_pool_is_served_identically(deep_llama, tmp_path):
    path = tmp_path / "headwise.json"
    args = ["--model", str(deep_llama), "--prompt", "60", "--tokens", "4", "--block-size", "4",
            "--threads", "1", "--disk-dir", str(tmp_path), "--json", str(path)]
    assert headwise.main(args) == 0
    r = json.loads(path.read_text())
    assert r["request_blocks"] == 16 and r["pool_blocks"] == 4
    assert r["outputs_identical"] is True and len(r["tokens"]) == 4
    assert r["offloaded"]["bytes_into_compute"] > 0 and r["resident"]["bytes_into_compute"] == 0
    assert 0 <= r["offloaded"]["stall_share"] <= 1
