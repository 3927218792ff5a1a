"""A search's time budget, by the wall clock, as a client sees it: `timeout_s = T` answers within
T x 1.1 + 0.5 s, plus the process hop and two of the search's own steps (measured in the same search, so
the allowance grows with a busy machine's load), also on a small pool with a host tier and with the
judge, whose verification is abandoned at the deadline."""

import json
import time

import httpx
import pytest

from tests.server.live import live_server

T = 2.0
# The confidence search is cheap: on a fast CPU its 480 steps on the tiny model end within 2 s, so its
# budget is shorter, to be sure the budget is what ends it.
BUDGETS = {"judge": T, "confidence": 1.0}
SLACK = 1.5  # process hop and HTTP: not the search's own overrun


def bound(budget: float, summary: dict) -> float:
    """The budget with its allowance: the deadline is checked at every engine step, so the search may
    overrun it by the step it is in (and the verification abandoned there); that step's length is taken
    from the search's own seconds per step, not assumed."""
    step_s = (summary["seconds_generating"] + summary["seconds_verifying"]) / max(1, summary["steps"])
    return budget * 1.1 + 0.5 + SLACK + 2 * step_s


@pytest.fixture(scope="module")
def server(tiny_llama):
    env = {"PONDER_CACHE__NUM_BLOCKS": "160", "PONDER_CACHE__BLOCK_SIZE": "4",
           "PONDER_CACHE__HOST_MEMORY_GIB": "0.01", "PONDER_SEARCH__MAX_PATHS": "16",
           "PONDER_SEARCH__MAX_STEPS": "1000", "PONDER_SEARCH__MAX_TOTAL_TOKENS": "100000"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


def body(server: str, verifier: str, stream: bool = False, budget: float = T) -> dict:
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    return {"model": model, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 480,
            "temperature": 1.0, "seed": 3, "stream": stream,
            "search": {"strategy": "beam", "n": 16, "beam_width": 4, "max_steps": 1000, "max_step_tokens": 1,
                       "verifier": verifier, "timeout_s": budget}}


@pytest.mark.parametrize("verifier", ["judge", "confidence"])
def test_a_search_answers_within_its_time_budget(server, verifier):
    budget = BUDGETS[verifier]
    payload = body(server, verifier, budget=budget)
    start = time.monotonic()
    resp = httpx.post(server + "/v1/chat/completions", json=payload, timeout=60)
    elapsed = time.monotonic() - start
    assert resp.status_code == 200, resp.text
    summary = resp.json()["search"]
    assert summary["timed_out"] is True, summary  # 480 verified steps cannot finish in the budget: it ended them
    # The judge's step is verified in full when its scores all arrived in the engine step the deadline
    # passed in; otherwise its verification was not started, or abandoned. Confidence always scores.
    assert summary["cut_step_verified"] in ((True,) if verifier == "confidence" else (True, False))
    assert elapsed <= bound(budget, summary), f"answered after {elapsed:.2f} s, budget {budget} s"


def test_a_streamed_search_ends_within_its_time_budget(server):
    payload = body(server, "judge", stream=True)
    start = time.monotonic()
    with httpx.stream("POST", server + "/v1/chat/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    elapsed = time.monotonic() - start
    assert lines[-1] == "data: [DONE]"
    summary = json.loads(lines[-2][len("data: "):])["search"]
    assert summary["timed_out"] is True
    assert elapsed <= bound(T, summary), f"the stream ended after {elapsed:.2f} s, budget {T} s"
