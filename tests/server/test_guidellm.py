"""guidellm (a widely used OpenAI load generator) drives a live `ponder serve`: a short bounded run of
streamed chat and text completions, every request successful with exactly its output tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.live import live_server

GUIDELLM = Path(sys.executable).parent / "guidellm"
if not GUIDELLM.exists():
    pytest.skip("guidellm is not installed (make install: the `clients` extra)", allow_module_level=True)

NUM_REQUESTS = 4
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def base(tiny_llama):
    with live_server("--model", str(tiny_llama), "--device", "cpu",
                     env={"PONDER_CACHE__NUM_BLOCKS": "512", "PONDER_CACHE__BLOCK_SIZE": "4"}) as (url, _):
        yield url


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_bounded_run_has_no_errors(base, tiny_llama, tmp_path, request_format):
    out = tmp_path / "guidellm.json"
    cmd = [str(GUIDELLM), "run",
           "--backend", f"kind=openai_http,target={base},model={tiny_llama.name},request_format={request_format}",
           "--profile", "kind=concurrent,streams=2",
           "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
           "--constraint", "kind=max_duration,seconds=240",
           "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_llama}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [bench] = json.loads(out.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (NUM_REQUESTS, 0, 0), totals
    done = bench["requests"]["successful"]
    assert len(done) == NUM_REQUESTS
    for req in done:
        body = json.loads(req["request_args"])["body"]
        assert body["stream"] is True and body.get("ignore_eos") is True
        assert req["output_tokens"] == OUTPUT_TOKENS and req["prompt_tokens"] > 0
        assert req["output"] and req["time_to_first_token_ms"] > 0
