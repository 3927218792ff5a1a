"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = self.headers or ({"WWW-Authenticate": "Bearer"} if self.status == 401 else None)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def anthropic_body(self) -> dict:
        """Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`; the field it names leads
        the message, as Anthropic's own messages name it."""
        message = self.message
        if self.param and not message.startswith(self.param + ":"):
            message = f"{self.param}: {message}"
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response_for(self, path: str) -> JSONResponse:
        """The error in the shape of the API `path` belongs to: Anthropic's under /v1/messages, else OpenAI's."""
        if not path.startswith(ANTHROPIC_PATH):
            return self.response()
        return JSONResponse(self.anthropic_body(), status_code=self.status, headers=self.headers)


# Anthropic's Messages API (server.messages_api) answers its errors in Anthropic's shape and types.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


# Parts of a pydantic error location that name a member of a union, not a field: `literal['a','b']`,
# `function-after[...]`, a model's class name, a type's name.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(part) -> bool:
    if isinstance(part, int):
        return True
    return not ("[" in part or "(" in part or part[:1].isupper() or part in _UNION_TAGS)


def _describe(error: dict) -> tuple[str, str | None]:
    loc = [str(p) for p in error.get("loc", ()) if p != "body" and _is_field(p)]
    param = ".".join(loc) or None
    if error.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(error.get("ctx", {}).get("error", error.get("msg"))), None
    message = error.get("msg", "invalid value")
    return (f"{param}: {message}" if param else message), param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = _describe(errors[0]) if errors else ("invalid request", None)
        return APIError(400, message, param).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}",
                            code="not_found").response_for(request.url.path)
        if exc.status_code == 405:
            return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response_for(
                request.url.path)
        return APIError(exc.status_code, str(exc.detail)).response_for(request.url.path)
