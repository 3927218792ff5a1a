"""POST /v1/rewards over a live server: a Qwen2.5-Math-PRM replica scores given steps exactly as its
model card's own code does; the judge scores as it does in the runtime; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.replicas.verifiers import write_verifier
from tests.runtime.verify.test_replica_verifier_layouts import (
    ATOL, QUESTION, QWEN_SYSTEM as SYSTEM, STEPS, qwen_prm_card_scores,
)
from tests.server.live import live_server, metric

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return write_verifier("qwen-prm", tmp_path_factory.mktemp("rewards") / "qwen-prm")


@pytest.fixture(scope="module")
def server(tiny_llama, prm_dir):
    env = {"PONDER_CACHE__NUM_BLOCKS": "256", "PONDER_CACHE__BLOCK_SIZE": "4",
           "PONDER_VERIFIERS__QWEN__KIND": "qwen-prm", "PONDER_VERIFIERS__QWEN__PATH": str(prm_dir),
           "PONDER_SEARCH__MAX_STEPS": "8", "PONDER_LIMITS__MAX_N": "4"}
    with live_server("--model", str(tiny_llama), "--api-key", KEY, "--device", "cpu", "--max-model-len", "512",
                     env=env, timeout=600) as (base, _):
        yield base


def post(server, body, headers=AUTH):
    return httpx.post(server + "/v1/rewards", json=body, headers=headers, timeout=60)


def model_card_scores(directory, steps: list[str]) -> list[float]:
    return qwen_prm_card_scores(directory, QUESTION, steps)


@pytest.mark.parametrize("form", ["messages", "steps", "input"])
def test_a_process_reward_model_scores_as_its_model_card_does(server, prm_dir, form):
    expected = model_card_scores(prm_dir, STEPS)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    body = {"messages": [*conversation, {"role": "assistant", "content": "\n\n".join(STEPS)}]} if form == "messages" \
        else {"messages": conversation, "steps": STEPS} if form == "steps" \
        else {"prompt": QUESTION, "input": [{"steps": STEPS[:1]}, {"response": "\n\n".join(STEPS) + "\n\n"}]}
    r = post(server, {**body, "aggregation": "min"})
    assert r.status_code == 200, r.text
    answer = r.json()
    # qwen is the only reward model configured: the default verifier
    assert answer["object"] == "rewards" and answer["verifier"] == "qwen" and answer["model"]
    last = answer["data"][-1]
    assert last["index"] == len(answer["data"]) - 1 and last["steps"] == STEPS
    assert last["step_scores"] == pytest.approx(expected, abs=ATOL)
    assert last["score"] == min(last["step_scores"])
    if form == "input":
        assert answer["data"][0]["step_scores"] == pytest.approx(model_card_scores(prm_dir, STEPS[:1]), abs=ATOL)
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert usage["prompt_tokens"] > 0


def test_the_judge_answers_through_the_route(server):
    r = post(server, {"prompt": "w1 w2 w3", "steps": ["w4 w5", "w6"], "verifier": "judge"})
    assert r.status_code == 200, r.text
    scores = r.json()["data"][0]["step_scores"]
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)


@pytest.mark.parametrize("body, param", [
    ({"prompt": QUESTION}, "response"),
    ({"messages": [{"role": "user", "content": QUESTION}]}, "response"),
    ({"prompt": QUESTION, "steps": []}, "steps"),
    ({"prompt": QUESTION, "steps": ["a", " "]}, "steps"),
    ({"prompt": QUESTION, "response": "\n\n\n\n"}, "response"),
    ({"prompt": QUESTION, "input": [{"steps": ["a"]}, {}]}, "input.1"),
    ({"prompt": QUESTION, "input": [{"steps": ["a"]}, {"steps": []}]}, "input.1.steps"),
    ({"prompt": QUESTION, "steps": ["a"], "verifier": "oracle"}, "verifier"),
    ({"prompt": QUESTION, "steps": ["a"], "verifier": "calculator"}, "verifier"),
    ({"prompt": QUESTION, "steps": ["a"], "response": "a"}, "response"),
    ({"steps": ["a"]}, "messages"),
    ({"prompt": QUESTION, "steps": ["a"] * 9}, "steps"),  # over search.max_steps
    ({"prompt": QUESTION, "input": [{"steps": ["a"]}] * 5}, "input"),  # over limits.max_n
    ({"prompt": QUESTION, "response": "eggs " * 600}, "response"),  # over the verifier's context
    ({"prompt": QUESTION, "steps": ["a"], "aggregation": "max"}, "aggregation"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_same_auth_and_counted_like_the_other_routes(server):
    assert post(server, {"prompt": QUESTION, "steps": ["a"]}, headers={}).status_code == 401
    before = metric(server, "ponder_http_requests_total", AUTH, default=0.0, route="/v1/rewards", method="POST",
                    status="200")
    assert post(server, {"prompt": QUESTION, "steps": ["a"]}).status_code == 200
    after = metric(server, "ponder_http_requests_total", AUTH, route="/v1/rewards", method="POST", status="200")
    assert after == before + 1
