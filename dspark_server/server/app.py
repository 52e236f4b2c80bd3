"""FastAPI routes: OpenAI-compatible completions, health/readiness, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dspark_server.config import ServerConfig
from dspark_server.engine.backend import Backend
from dspark_server.engine.request import InvalidRequestError, RequestOutput, SamplingParams
from dspark_server.server.metrics import Metrics
from dspark_server.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    new_id,
)
from dspark_server.server.responses import ChatFormatter, CompletionFormatter, Formatter

log = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


@dataclass
class ServerState:
    backend: Backend
    cfg: ServerConfig
    model_name: str
    metrics: Metrics
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)


def create_app(backend: Backend, cfg: ServerConfig, model_name: str) -> FastAPI:
    app = FastAPI(title="dspark-server", version="0.1.0",
                  description="OpenAI-compatible server with DSpark speculative decoding")
    state = ServerState(backend, cfg, model_name, Metrics(backend.stats))
    app.state.dspark = state

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        if path.startswith("/v1/"):
            if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
                return _error(APIError(401, "Invalid or missing API key (send 'Authorization: "
                                            "Bearer <key>').", "authentication_error"))
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
                return _error(APIError(413, f"Request body of {length} bytes exceeds the limit of "
                                            f"{cfg.max_body_bytes} bytes."))
        response = await call_next(request)
        if path.startswith("/v1/") and request.method == "POST":
            state.metrics.count_request(path, response.status_code)
        return response

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(_validation_api_error(exc))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready() -> JSONResponse:
        if state.draining or not backend.ready:
            reason = "draining" if state.draining else "loading"
            return _error(APIError(503, f"server is {reason}", "service_unavailable"))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=backend.max_model_len)])

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = backend.tokenizer.encode_chat(messages)
        except Exception as exc:  # template errors (e.g. unsupported role order) are client errors
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _serve(state, request, body, prompt_ids, max_tokens,
                            ChatFormatter(new_id("chatcmpl"), model_name))

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt_ids = _completion_prompt(backend, body.prompt)
        return await _serve(state, request, body, prompt_ids, body.max_tokens,
                            CompletionFormatter(new_id("cmpl"), model_name))

    return app


def _completion_prompt(backend: Backend, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return backend.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _completion_prompt(backend, prompt[0])
    raise APIError(400, "prompt must be a string, a list of token ids, or a list holding exactly one "
                        "of those (batched prompts are not supported)", param="prompt")


async def _serve(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                 prompt_ids: list[int], max_tokens: int | None, fmt: Formatter) -> Response:
    backend = state.backend
    if body.model and body.model != state.model_name:
        raise APIError(404, f"The model `{body.model}` does not exist.", "NotFoundError", "model",
                       "model_not_found")
    if state.draining or not backend.ready:
        raise APIError(503, "server is not accepting requests (draining or loading)",
                       "service_unavailable", headers={"Retry-After": "5"})
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if max_tokens is None:
        max_tokens = max(1, backend.max_model_len - len(prompt_ids))
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, seed=body.seed, max_tokens=max_tokens, stop=body.stop_list(),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
        backend.validate(prompt_ids, params)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    if not backend.can_accept():
        raise APIError(429, "the server's request queue is full; retry later", "rate_limit_exceeded",
                       headers={"Retry-After": "1"})
    request_id = fmt.response_id
    stream = backend.generate(request_id, prompt_ids, params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(stream, fmt, include_usage), media_type="text/event-stream")
    return await _collect_until_disconnect(request, stream, fmt)


async def _sse(stream: AsyncIterator[RequestOutput], fmt: Formatter,
               include_usage: bool) -> AsyncIterator[str]:
    try:
        first = True
        async for out in stream:
            if out.error:
                yield f"data: {json.dumps(APIError(500, out.error, 'internal_error').body())}\n\n"
                break
            for chunk in fmt.stream_chunks(out, first, include_usage):
                yield f"data: {json.dumps(chunk)}\n\n"
            first = False
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def _collect_until_disconnect(request: Request, stream: AsyncIterator[RequestOutput],
                                    fmt: Formatter) -> Response:
    outputs: list[RequestOutput] = []

    async def collect() -> None:
        async for out in stream:
            outputs.append(out)

    task = asyncio.create_task(collect())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    task.result()
    if outputs and outputs[-1].error:
        raise APIError(500, outputs[-1].error, "internal_error")
    return JSONResponse(fmt.full_response(outputs))


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _validation_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {msg}")
    return APIError(400, f"invalid value for '{where}': {msg}", param=param)
