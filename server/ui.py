"""The live search-tree page: `GET /ui`, the list of searches, one tree, and one tree's event stream.

A browser cannot send a bearer token when it opens a page, so besides `Authorization: Bearer <key>`
these routes take HTTP Basic credentials with the API key as the password (any user name): the
browser asks once, then sends them with the page's own requests and its event stream.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import AsyncIterator
from functools import lru_cache
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.errors import APIError
from server.trees import SearchTrees, Subscriber

PAGE = Path(__file__).with_name("ui.html")
RECONNECT_MS = 1000  # how soon a page's stream reconnects after the server ended it (a slow reader)
SEND_TIMEOUT_S = 30.0  # a stream whose client accepts nothing for this long is closed


@lru_cache(maxsize=1)
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def _presented_key(header: str) -> bytes | None:
    scheme, _, value = header.partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "bearer":
        return value.encode()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(b":")[2]
    return None


def install(app: FastAPI, trees: SearchTrees, api_key: bytes | None, keepalive_s: float) -> None:
    """Add the page's routes to `app` itself (not as an included router), so the edge metrics see each
    route's template."""
    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        presented = _presented_key(request.headers.get("authorization", ""))
        # compare_digest runs in time independent of where the strings differ.
        if presented is None or not hmac.compare_digest(presented, api_key):
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`, or the key as "
                                "the password of HTTP Basic authentication", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Basic realm="ponder", charset="UTF-8"'})

    guarded = dict(dependencies=[Depends(require_key)], include_in_schema=False)

    def tree_or_404(search_id: str):
        tree = trees.get(search_id)
        if tree is None:
            raise APIError(404, f"no search {search_id!r}: it is unknown, or older than the last "
                                f"{trees.max_trees} searches this server keeps", "search_id", "search_not_found")
        return tree

    @app.get("/ui", **guarded)
    async def ui_page():
        return HTMLResponse(page(), headers={"Cache-Control": "no-store"})

    @app.get("/ui/searches", **guarded)
    async def list_searches():
        return {"object": "list", "max_trees": trees.max_trees, "data": trees.summaries()}

    @app.get("/ui/searches/{search_id}", **guarded)
    async def get_search(search_id: str):
        return tree_or_404(search_id).snapshot()

    @app.get("/ui/searches/{search_id}/events", **guarded)
    async def search_events(search_id: str):
        subscriber = trees.subscribe(tree_or_404(search_id))
        return EventSourceResponse(_events(trees, subscriber), ping=keepalive_s, send_timeout=SEND_TIMEOUT_S,
                                   headers={"Cache-Control": "no-cache"})



async def _events(trees: SearchTrees, subscriber: Subscriber) -> AsyncIterator[ServerSentEvent]:
    """The tree now (`tree`), then its deltas (`delta`) and its end (`state`); the stream ends with the
    tree, or when its reader fell too far behind (then the page reconnects for a fresh snapshot)."""
    try:
        first = True
        while True:
            item = await subscriber.queue.get()
            if item is None:
                return
            event, payload = item
            data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            yield ServerSentEvent(data=data, event=event, retry=RECONNECT_MS if first else None)
            first = False
    finally:
        trees.unsubscribe(subscriber)
