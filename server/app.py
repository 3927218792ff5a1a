"""The HTTP process: OpenAI routes, health, metrics, auth, CORS and body limits."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import Callable

import msgspec

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.wire.client import READY, RuntimeClient, RuntimeUnavailable, SpawnedRuntime
from runtime.wire.params import Constraint, ToolCalling
from runtime.wire.protocol import DetokenizeRequest, GenerateRequest, RequestError, TokenizeRequest
from server import errors
from server.config import Settings
from server.errors import APIError
from server.extras import check_fields
from server.generation import Generation
from server.chat_bridge import ChatBridge
from server.http_edge import EdgeMetrics, quiet_probe_access_log
from server.messages_api.routes import install as install_messages_api
from server.responses_api.routes import install as install_responses_api
from server.responses_api.store import response_store
from server.metrics import Metrics
from server.non_openai_schemas import DetokenizeBody, RewardsBody, TokenizeBody
from server.responses import PromptAsks
from server.rewards import reward_request, rewards_body
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.reasoning_output import Thinking
from server.tool_output import ToolCalls
from server.trees import SearchTrees
from server.ui import install as install_ui

log = logging.getLogger("ponder.server")


class BodyLimit:
    """413 for bodies over the limit, whether announced by Content-Length or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = APIError(413, _TooLarge(self.max_bytes).detail).response_for(scope["path"])
        await response(scope, receive, send)


class _TooLarge(HTTPException):
    """Raised while the route reads the body. An HTTPException, because FastAPI turns any other error
    from reading the body into a 400; the app's handler renders it as an OpenAI-shaped 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")


def create_app(settings: Settings, client: RuntimeClient | None = None, metrics: Metrics | None = None,
               runtime: SpawnedRuntime | None = None, on_load_failed: Callable[[str], None] | None = None) -> FastAPI:
    """The app over `client`, or over a client of its own that adopts `runtime` (a runtime process
    `ponder serve` started and whose settings check passed) or starts one. `on_load_failed` is called
    with the runtime's message where the model cannot load (`ponder serve` then exits)."""
    metrics = metrics or Metrics()
    if client is None:
        client = RuntimeClient(settings.runtime_options(), on_stats=metrics.apply_runtime_stats, spawned=runtime)
    def on_state(new_state: str) -> None:
        metrics.set_runtime_up(new_state == READY)
        if new_state == READY and client.info is not None:
            metrics.set_model_info(client.info.model, client.info.dtype, client.info.device, client.info.quantize)
            if client.num_restarts:
                metrics.runtime_restarted()

    trees = SearchTrees(settings.ui.max_trees)
    client.on_state = on_state
    client.on_stats = metrics.apply_runtime_stats
    client.on_tree = trees.apply

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        with quiet_probe_access_log(not settings.server.access_log_probes):
            await client.start(wait=False)
            watch = asyncio.create_task(_watch_load(client, on_load_failed)) if on_load_failed else None
            try:
                yield
            finally:
                if watch is not None:
                    watch.cancel()
                await client.stop()

    app = FastAPI(title="ponder", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server with verifier-guided tree search.")
    errors.install(app)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(EdgeMetrics, metrics=metrics, routes=app.router.routes)  # outermost: sees every answer

    api_key = settings.server.api_key.get_secret_value().encode() if settings.server.api_key else None

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header and "x-api-key" in request.headers:  # Anthropic's header, accepted on every route
            scheme, token = "bearer", request.headers["x-api-key"]
        # compare_digest runs in time independent of where the strings differ.
        if not hmac.compare_digest(token.strip().encode(), api_key) or scheme.lower() != "bearer":
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                           code="invalid_api_key")

    def served_model() -> str:
        if client.info is None:
            raise APIError(503, "the model is still loading", code="model_loading")
        return client.info.model

    def check_model(name: str | None) -> str:
        model = served_model()
        if name is not None and name != model:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model}`",
                           "model", "model_not_found")
        return model

    @app.get("/health", include_in_schema=False)
    async def health():
        if client.state == READY:
            return {"status": "ok", "model": client.info.model if client.info else None}
        message = client.load_error or f"the runtime is {client.state}"
        return APIError(503, message, code="runtime_" + client.state).response()

    metrics_guard = [] if settings.server.public_metrics else [Depends(require_key)]

    @app.get("/metrics", dependencies=metrics_guard, include_in_schema=False)
    async def metrics_endpoint():
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def list_models():
        model = served_model()
        info = client.info
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "ponder",
                                            "max_model_len": info.max_model_len if info else None,
                                            "quantize": info.quantize if info else None,
                                            "block_types": list(info.block_types) if info else None,
                                            "sampling_defaults": dict(info.sampling_defaults) if info else None,
                                            "paths": dict(info.paths) if info else None}]}

    def thinking_of(body) -> Thinking | None:
        """How a chat answer's thinking is told from its answer, or None where it is not."""
        fmt = settings.model.reasoning_parser
        if fmt == "auto":
            fmt = client.info.reasoning_format if client.info else "none"
        if isinstance(body, ChatCompletionRequest) and body.thinking_budget[1] is not None and (
                client.info is None or client.info.reasoning_format == "none"):
            field = body.thinking_budget[0]
            raise APIError(400, f"{field}: this model does not think in its text (its chat template names no "
                                "thinking format), so there is no thinking to budget", field)
        if not isinstance(body, ChatCompletionRequest) or fmt == "none" or body.reasoning_format == "none":
            return None
        return Thinking(fmt, include=body.include_reasoning)

    def template_variables(asked: dict | None) -> dict:
        """Thinking on unless said otherwise, as llama-server passes it (a template that tests `not
        enable_thinking` would close the block otherwise), then the server's defaults, then the request's."""
        return {"enable_thinking": True, **settings.model.chat_template_kwargs, **(asked or {})}

    async def generate(body, request: Request, endpoint: str, prompts: list[dict], label: str | None = None):
        """Check the body against the served model and the caps, then run one runtime request per prompt;
        `label`: the endpoint named in metrics, when another API runs the chat path."""
        check_fields(body, endpoint, settings.server.unknown_fields)
        model = check_model(body.model)
        _check_limits(settings, body, client.info.max_model_len if client.info else None)
        _check_verifier(body, client.info.verifiers if client.info else ())
        _check_prompt_asks(body)
        constraint, tools = _output_shape(body)
        options = body.stream_options
        include_events = bool(options and options.include_search_events)
        sampling = body.to_sampling(client.info.sampling_defaults if client.info else {})
        # A stream reports every search step: as chunks when asked for, else as SSE comments.
        search = body.search.to_params(include_events or body.stream, settings.search.max_timeout_s) \
            if body.search else None
        if search is not None and trees.is_enabled:
            search = msgspec.structs.replace(search, include_tree=True)  # for the page at /ui
        template_kwargs = template_variables(body.chat_template_kwargs) if endpoint == "chat" else {}
        wires = [GenerateRequest(request_id=uuid.uuid4().hex, endpoint=endpoint, sampling=sampling, search=search,
                                 constraint=constraint, tools=tools, chat_template_kwargs=template_kwargs, **prompt)
                 for prompt in prompts]
        asks = PromptAsks(echo_logprobs=getattr(body, "echo_logprobs", None), prompt_logprobs=body.prompt_logprobs,
                          continuous_usage=bool(options and options.continuous_usage_stats))
        calls = ToolCalls(client.info.tool_call_format if client.info else "hermes",
                          legacy=getattr(body, "uses_functions", False)) if tools is not None else None
        return await Generation(client, metrics, request, model, endpoint, wires, body.n, body.stream,
                                bool(options and options.include_usage), include_events,
                                settings.server.sse_keepalive_s, trees, asks, calls, label,
                                thinking_of(body)).run()

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request, "chat", [{"messages": body.wire_messages()}])

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": tuple(p)} for p in body.prompts()]
        return await generate(body, request, "completion", prompts)

    async def ask_runtime(message):
        try:
            answer = await client.ask(message)
        except RuntimeUnavailable as exc:
            raise APIError(503, str(exc), code="runtime_unavailable") from None
        if isinstance(answer, RequestError):
            raise APIError(answer.status, answer.message, answer.param, answer.code, answer.type)
        return answer

    async def count_chat_tokens(body: ChatCompletionRequest) -> int:
        check_model(body.model)
        _, tools = _output_shape(body)  # rendered as the chat request renders them (none with tool_choice none)
        answer = await ask_runtime(TokenizeRequest(request_id=uuid.uuid4().hex, messages=body.wire_messages(),
                                                   add_special_tokens=False, tools=tools))
        return len(answer.token_ids)

    bridge = ChatBridge(
        run=lambda body, request, label: generate(body, request, "chat", [{"messages": body.wire_messages()}], label),
        count_tokens=count_chat_tokens, model=check_model, dependencies=[Depends(require_key)],
        keepalive_s=settings.server.sse_keepalive_s)
    install_messages_api(app, bridge)
    install_responses_api(app, bridge, response_store(settings.responses))

    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeBody):
        """vLLM's /tokenize: the prompt's token ids (messages through the chat template), as generation sees them."""
        check_fields(body, "tokenize", settings.server.unknown_fields)
        check_model(body.model)
        add_special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        answer = await ask_runtime(TokenizeRequest(
            request_id=uuid.uuid4().hex, prompt=body.prompt, messages=body.wire_messages(),
            add_special_tokens=add_special, add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=template_variables(body.chat_template_kwargs)))
        return {"tokens": list(answer.token_ids), "count": len(answer.token_ids), "max_model_len": answer.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeBody):
        check_fields(body, "detokenize", settings.server.unknown_fields)
        check_model(body.model)
        answer = await ask_runtime(DetokenizeRequest(request_id=uuid.uuid4().hex, token_ids=tuple(body.tokens)))
        return {"prompt": answer.text}

    @app.post("/v1/rewards", dependencies=[Depends(require_key)])
    async def rewards(body: RewardsBody):
        """Score the client's own response(s) step by step with a verifier, as a search scores its paths."""
        check_fields(body, "rewards", settings.server.unknown_fields)
        model = check_model(body.model)
        wire = reward_request(body, client.info.verifiers if client.info else (), settings.limits.max_n,
                              settings.search.max_steps)
        return rewards_body(await ask_runtime(wire), model, wire)

    if trees.is_enabled:
        install_ui(app, trees, api_key, settings.server.sse_keepalive_s)

    return app


async def _watch_load(client: RuntimeClient, on_load_failed: Callable[[str], None]) -> None:
    """Call `on_load_failed` once the runtime says its model cannot load; return once it is ready."""
    while True:
        try:
            await client.wait_ready()
            return
        except asyncio.TimeoutError:
            continue  # a large model loads for longer than the client's load timeout: keep waiting
        except RuntimeUnavailable as exc:
            on_load_failed(str(exc))
            return


def _output_shape(body) -> tuple[Constraint | None, ToolCalling | None]:
    """The request's constraint and tools, or a 400 naming the field that cannot be obeyed."""
    refused = body.refused_field() if isinstance(body, ChatCompletionRequest) else None
    if refused is not None:
        raise APIError(400, f"{refused[0]}: {refused[1]}", refused[0])
    try:
        constraint = body.constraint()
    except ValueError as exc:
        raise APIError(400, str(exc), "response_format") from None
    tools = None
    if isinstance(body, ChatCompletionRequest):
        try:
            tools = body.tool_calling()
        except ValueError as exc:
            raise APIError(400, str(exc), "functions" if body.functions is not None else
                           "tool_choice" if "tool_choice" in str(exc) else "tools") from None
    if tools is not None and constraint is not None:
        raise APIError(400, "tools that may be called cannot be combined with a response_format or "
                            "structured_outputs (set tool_choice to none, or leave the format out)", "response_format")
    return constraint, tools


def _check_verifier(body, verifiers: tuple[str, ...]) -> None:
    if body.search is not None and body.search.verifier not in verifiers:
        raise APIError(400, f"unknown verifier {body.search.verifier!r}; this server has {', '.join(verifiers)}",
                       "search.verifier")


def _check_prompt_asks(body) -> None:
    """max_tokens 0 returns the prompt alone, so something of it must be asked for; and the prompt comes
    back only from a plain request: a search answers with its paths."""
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise APIError(400, "max_tokens must be at least 1, or 0 with echo or prompt_logprobs (the prompt alone)",
                       "max_tokens")
    if body.search is None:
        return
    if getattr(body, "echo", False):
        raise APIError(400, "echo cannot be combined with search", "echo")
    if body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs cannot be combined with search", "prompt_logprobs")


def _check_limits(settings: Settings, body, max_model_len: int | None) -> None:
    limits = settings.limits
    if body.n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n}", "n")
    stops = body.stop_list()
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"at most {limits.max_stop_strings} stop strings are allowed", "stop")
    if any(len(s) > limits.max_stop_string_length for s in stops):
        raise APIError(400, f"stop strings may be at most {limits.max_stop_string_length} characters", "stop")
    search = body.search
    if search is None:
        return
    caps = settings.search
    for field, value, cap in [("n", search.n, caps.max_paths), ("beam_width", search.beam_width, caps.max_beam_width),
                              ("max_steps", search.max_steps, caps.max_steps)]:
        if value > cap:
            raise APIError(400, f"search.{field} is {value}, over this server's cap of {cap}", f"search.{field}")
    if search.timeout_s is not None and not 1 <= search.timeout_s <= caps.max_timeout_s:
        raise APIError(400, f"search.timeout_s is {search.timeout_s}; it must lie between 1 and this server's cap "
                            f"of {caps.max_timeout_s} seconds", "search.timeout_s")
    per_path = body.max_tokens if isinstance(body, CompletionRequest) else (
        body.max_completion_tokens or body.max_tokens)
    total = search.n * (per_path or max_model_len or 0)
    if total > caps.max_total_tokens:
        raise APIError(400, f"search.n x max_tokens is {total} tokens, over this server's cap of "
                            f"{caps.max_total_tokens}; lower search.n or max_tokens", "search.n")

