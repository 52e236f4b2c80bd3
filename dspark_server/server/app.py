"""FastAPI routes: OpenAI-compatible completions, health/readiness, metrics, and the guard
(auth, body limit and deadline, request counting, drain bookkeeping) in front of them.

Every error a client can cause is a 4xx with the OpenAI body ``{"error": {message, type, param,
code}}``; a 500 means a bug in this server. A client that disconnects (streaming or not) aborts its
request, and the engine frees its KV at the start of its next step.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend, QueueFullError
from dspark_server.engine.request import InvalidRequestError, SamplingParams
from dspark_server.server.guard import RETRY_AFTER_UNAVAILABLE_S, Guard, error_response
from dspark_server.server.metrics import Metrics
from dspark_server.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    new_id,
)
from dspark_server.server.responses import ChatFormatter, CompletionFormatter, Formatter
from dspark_server.server.state import ServerState
from dspark_server.server.streaming import EngineSSEResponse, collect_until_disconnect, sse_events
from dspark_server.server.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

RETRY_AFTER_QUEUE_FULL_S = 1

_RETRY_AFTER_HEADER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}
}


def _error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]}
        if code in (429, 503):
            entry["headers"] = _RETRY_AFTER_HEADER
        out[code] = entry
    return out


_ERROR_DESCRIPTIONS = {
    400: "invalid request (malformed JSON, wrong types, values out of range, over the context)",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request body did not arrive within the body timeout",
    413: "request body (or prompt characters) over the size limit",
    429: "the server holds as many requests (or long prompts to tokenize) as it may; retry after "
    "Retry-After seconds",
    503: "the server is loading or draining",
}


def _unavailable(message: str, code: str) -> Response:
    """A 503 of the probes (``/health``, ``/ready``) with an OpenAI-style error body."""
    return error_response(APIError(503, message, "service_unavailable", code=code))


# ---- the app ---------------------------------------------------------------------------------


def create_app(backend: Backend | None, cfg: ServerConfig, model_name: str) -> FastAPI:
    """The app; ``backend`` may be None while the model loads (attach it later with
    ``app.state.dspark.attach(backend)``): until then ``/ready`` and ``/v1/*`` answer 503."""
    app = FastAPI(
        title="dspark-server",
        version="0.1.0",
        description="OpenAI-compatible server with DSpark speculative decoding",
    )
    state = ServerState(cfg, model_name, Metrics(lambda: state))
    tokenize = PromptTokenizer(cfg)
    if backend is not None:
        state.attach(backend)
    app.state.dspark = state
    paths: set[str] = set()

    def endpoints() -> set[str]:
        if not paths:
            paths.update(getattr(r, "path", "") for r in app.routes)
        return paths

    app.add_middleware(Guard, state=state, endpoints=endpoints)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(
            APIError(exc.status_code, str(exc.detail), type_, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", "internal_error"))

    @app.get(
        "/health",
        response_model=HealthResponse,
        responses=_error_responses(503),
        summary="Health: the model is loaded and its engine runs (503 while loading, as in SGLang)",
    )
    async def health() -> Response:
        if state.backend is None:
            return _unavailable("server is loading", "server_loading")
        if not state.backend.ready:
            return _unavailable("the engine is not running", "engine_down")
        return JSONResponse(HealthResponse().model_dump())

    @app.get(
        "/ready",
        response_model=ReadyResponse,
        responses=_error_responses(503),
        summary="Readiness: the engine is up and the server is not draining",
    )
    async def ready() -> Response:
        if not state.ready:
            reason = "draining" if state.draining else "loading"
            return _unavailable(f"server is {reason}", f"server_{reason}")
        return JSONResponse(ReadyResponse().model_dump())

    @app.get(
        "/metrics",
        response_class=Response,
        summary="Prometheus metrics",
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition format",
            }
        },
    )
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList, responses=_error_responses(401))
    async def models() -> ModelList:
        max_len = state.backend.max_model_len if state.backend is not None else None
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_len)])

    post_responses: dict[int | str, dict[str, Any]] = _error_responses(400, 401, 404, 408, 413, 429, 503)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {
                "model": ChatCompletionResponse,
                "description": "JSON, or SSE when stream is true",
                "content": _SSE_CONTENT,
            },
            **post_responses,
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        backend = _check_serving(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        tokenize.check_chars(backend, size, "messages")
        prompt_ids = await tokenize.run(
            lambda: backend.tokenizer.encode_chat(messages),
            size + 32 * len(messages),  # the template's work grows with the message count too
            "cannot apply the chat template",
            "messages",
        )
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _serve(
            state, request, body, prompt_ids, max_tokens, ChatFormatter(new_id("chatcmpl"), model_name)
        )

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {
                "model": CompletionResponse,
                "description": "JSON, or SSE when stream is true",
                "content": _SSE_CONTENT,
            },
            **post_responses,
        },
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        backend = _check_serving(state, body.model)
        prompt_ids = await _completion_prompt(backend, tokenize, body)
        return await _serve(
            state, request, body, prompt_ids, body.max_tokens, CompletionFormatter(new_id("cmpl"), model_name)
        )

    app.openapi = lambda: _openapi(app, cfg)  # type: ignore[method-assign]
    return app


# OpenAPI < 3.2: the schema of an event-stream media type describes one event.
_SSE_CONTENT = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "description": "one server-sent event: data is a chunk object as JSON text, or [DONE] last",
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        }
    }
}


def _openapi(app: FastAPI, cfg: ServerConfig) -> dict[str, Any]:
    """FastAPI's schema without its 422 responses (validation failures are 400 here) and, when
    an API key is configured, with the Bearer scheme on /v1/*."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            op.get("responses", {}).pop("422", None)
            if cfg.api_key and path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if cfg.api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema


def _check_serving(state: ServerState, model: str | None) -> Backend:
    if model and model != state.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist (this server serves `{state.model_name}`).",
            param="model",
            code="model_not_found",
        )
    if not state.ready or state.backend is None:
        reason = "shutting down" if state.draining else "loading the model"
        raise APIError(
            503,
            f"the server is {reason}; retry later",
            "service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
        )
    return state.backend


async def _completion_prompt(
    backend: Backend, tokenize: PromptTokenizer, body: CompletionRequest
) -> list[int]:
    prompt = body.prompt_input()  # the schema already refused empty and batched prompts
    if isinstance(prompt, list):
        return list(prompt)  # token ids: the engine checks the vocabulary and the context
    tokenize.check_chars(backend, len(prompt), "prompt")
    return await tokenize.run(
        lambda: backend.tokenizer.encode(prompt), len(prompt), "cannot tokenize the prompt", "prompt"
    )


async def _serve(
    state: ServerState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    fmt: Formatter,
) -> Response:
    backend = state.backend
    assert backend is not None
    if max_tokens is None:
        max_tokens = max(1, backend.max_model_len - len(prompt_ids))
    # Tiny temperatures and top_p values are handled where sampling happens (engine/sampling.py).
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    try:
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=body.stop_list(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
        )
        stream = backend.generate(fmt.response_id, prompt_ids, params)
    except InvalidRequestError as exc:
        code = "context_length_exceeded" if "context length" in str(exc) else None
        raise APIError(400, str(exc), param=exc.param, code=code) from exc
    except QueueFullError as exc:
        raise APIError(
            429,
            f"the server is at capacity ({exc}); retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_QUEUE_FULL_S)},
        ) from exc
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse_events(stream, fmt, include_usage, state.cfg.queue_timeout_s)
        return EngineSSEResponse(events, stream, state)
    return await collect_until_disconnect(request, stream, fmt, state)


def _validation_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # pydantic appends the union member tried ('str', 'list[int]', ...) to the location
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    where = ".".join(loc) if loc else "body"
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {msg}")
    if not loc:
        return APIError(400, f"invalid request body: {msg}")
    return APIError(400, f"invalid value for '{where}': {msg}", param=where)
