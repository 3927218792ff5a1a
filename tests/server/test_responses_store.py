"""Stored responses: the SQLite store's retention (a cap on rows, an age), a stored response surviving a
server restart, and a server with storing off writing nothing."""

from __future__ import annotations

import time

import httpx

from server.config import Settings
from server.responses_api.store import ResponseStore, default_path, response_store
from tests.server.live import live_server


def response(n: int) -> dict:
    return {"id": f"resp_{n}", "output": [{"type": "message", "n": n}]}


def test_put_get_delete_and_the_cap_drops_the_oldest(tmp_path):
    store = ResponseStore(tmp_path / "sub" / "r.sqlite3", max_stored=3, max_age_s=3600)
    assert not (tmp_path / "sub").exists()  # opened on first use
    for n in range(5):
        store.put(response(n), [{"type": "message", "role": "user", "content": str(n)}])
    assert store.count() == 3 and store.get("resp_1") is None
    kept = store.get("resp_4")
    assert kept.response == response(4) and kept.items == [{"type": "message", "role": "user", "content": "4"}]
    assert (tmp_path / "sub" / "r.sqlite3").stat().st_mode & 0o777 == 0o600
    assert store.delete("resp_4") and not store.delete("resp_4") and store.get("resp_4") is None
    store.close()
    again = ResponseStore(tmp_path / "sub" / "r.sqlite3", max_stored=3, max_age_s=3600)
    assert [again.get(f"resp_{n}") is not None for n in range(5)] == [False, False, True, True, False]


def test_responses_older_than_the_age_are_gone(tmp_path, monkeypatch):
    store = ResponseStore(tmp_path / "r.sqlite3", max_stored=10, max_age_s=60)
    store.put(response(0), [])
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert store.get("resp_0") is None
    store.put(response(1), [])  # a write deletes the expired rows
    assert store.count() == 1


def test_the_settings_choose_the_path_or_turn_storing_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "ponder" / "responses.sqlite3"
    assert response_store(Settings().responses).path == default_path()
    chosen = response_store(Settings(responses={"path": str(tmp_path / "x.db"), "max_stored": 5}).responses)
    assert (chosen.path, chosen.max_stored, chosen.max_age_s) == (tmp_path / "x.db", 5, 30 * 86400)
    assert response_store(Settings(responses={"store": False}).responses) is None


def create(base: str, **fields) -> httpx.Response:
    return httpx.post(base + "/v1/responses", json={"input": "w1 w2", "max_output_tokens": 2, **fields}, timeout=60)


def test_a_stored_response_survives_a_restart_and_storing_off_writes_nothing(tiny_llama, tmp_path):
    path = tmp_path / "responses.sqlite3"
    args = ("--model", str(tiny_llama), "--device", "cpu")
    with live_server(*args, env={"PONDER_RESPONSES__PATH": str(path)}) as (base, _):
        kept = create(base).json()
        unkept = create(base, store=False).json()
        assert (kept["store"], unkept["store"]) == (True, False)
    with live_server(*args, env={"PONDER_RESPONSES__PATH": str(path)}) as (base, _):
        assert httpx.get(f"{base}/v1/responses/{kept['id']}").json() == kept
        assert httpx.get(f"{base}/v1/responses/{unkept['id']}").status_code == 404
        chained = create(base, previous_response_id=kept["id"])
        assert chained.status_code == 200 and chained.json()["usage"]["input_tokens"] > kept["usage"]["input_tokens"]
    off = tmp_path / "off.sqlite3"
    with live_server(*args, env={"PONDER_RESPONSES__PATH": str(off), "PONDER_RESPONSES__STORE": "false"}) as (base, _):
        answer = create(base, store=True)
        assert answer.status_code == 200 and answer.json()["store"] is False
        assert httpx.get(f"{base}/v1/responses/{answer.json()['id']}").status_code == 404
        refused = create(base, previous_response_id=answer.json()["id"])
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    assert not off.exists() and not off.parent.joinpath("off.sqlite3-wal").exists()

