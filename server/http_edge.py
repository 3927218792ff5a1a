"""Counting every HTTP request at the edge: by route template, method and status, with its duration.

The middleware sits outside the body limit, CORS and auth, so 401, 404, 405, 413 and 422->400 answers
are counted like any other. The route label is the template a request matched (`/v1/models`), never
the raw path: a path no route knows is `unmatched`, and a method outside the standard ones is
`other`, so no client can grow the label sets. Probes (/health, /metrics) stay out of the access log
unless `server.access_log_probes` is set.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import Metrics

UNMATCHED = "unmatched"
OTHER_METHOD = "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route `scope` matches; a route that matches the path but not the method
    (a 405) still names it."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", UNMATCHED)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path", None)
    return partial or UNMATCHED


class EdgeMetrics:
    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the app's own list: routes added after start-up are seen too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        route = route_template(self.routes, scope)
        method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
        status = 500  # what the client gets when the app raises before it answers

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.http_request_finished(route, method, status, time.monotonic() - started)


PROBE_PATHS = frozenset({"/health", "/metrics"})


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn access-log lines of GET /health and GET /metrics: a health check and a Prometheus
    scrape every few seconds would bury the requests worth reading."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        path = str(args[2]).partition("?")[0]
        return path not in PROBE_PATHS


@contextlib.contextmanager
def quiet_probe_access_log(enabled: bool):
    """Install the filter on uvicorn's access logger for the app's lifetime (uvicorn has configured its
    logging by the time the app starts)."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("uvicorn.access")
    probe_filter = ProbeAccessFilter()
    logger.addFilter(probe_filter)
    try:
        yield
    finally:
        logger.removeFilter(probe_filter)
