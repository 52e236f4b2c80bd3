"""Turning engine deltas into OpenAI chat/completions bodies and SSE chunks."""

from __future__ import annotations

import time
from typing import Any, Protocol, cast

from dspark_server.engine.request import RequestOutput
from dspark_server.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    FinishReason,
    PromptTokensDetails,
    ResponseMessage,
    SpecUsage,
    Usage,
)


class Formatter(Protocol):
    response_id: str

    def stream_chunks(self, out: RequestOutput, first: bool, include_usage: bool) -> list[dict]: ...

    def full_response(self, outputs: list[RequestOutput]) -> dict[str, Any]: ...


def usage_of(out: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens),
        spec=SpecUsage.model_validate(out.spec.as_dict()),
    )


def _public_reason(reason: str | None) -> FinishReason:
    """The engine's reason as OpenAI's: an aborted request reads as stopped."""
    return cast(FinishReason, "stop" if reason == "abort" else reason)


class ChatFormatter:
    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        }

    def stream_chunks(self, out: RequestOutput, first: bool, include_usage: bool) -> list[dict]:
        chunks = []
        if first:
            chunks.append(self._chunk({"role": "assistant", "content": ""}, None))
        if out.new_text or out.finished:
            delta = {"content": out.new_text} if out.new_text else {}
            chunks.append(self._chunk(delta, _public_reason(out.finish_reason)))
        if out.finished and include_usage:
            chunks.append(
                {
                    "id": self.response_id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage_of(out).model_dump(),
                }
            )
        return chunks

    def full_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        text = "".join(o.new_text for o in outputs)
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            created=self.created,
            choices=[
                ChatChoice(
                    message=ResponseMessage(content=text), finish_reason=_public_reason(last.finish_reason)
                )
            ],
            usage=usage_of(last),
        ).model_dump()


class CompletionFormatter:
    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def stream_chunks(self, out: RequestOutput, first: bool, include_usage: bool) -> list[dict]:
        chunks = []
        if out.new_text or out.finished:
            chunks.append(
                {
                    "id": self.response_id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "text": out.new_text,
                            "logprobs": None,
                            "finish_reason": _public_reason(out.finish_reason),
                        }
                    ],
                }
            )
        if out.finished and include_usage:
            chunks.append(
                {
                    "id": self.response_id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage_of(out).model_dump(),
                }
            )
        return chunks

    def full_response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            created=self.created,
            choices=[
                CompletionChoice(
                    text="".join(o.new_text for o in outputs),
                    finish_reason=_public_reason(last.finish_reason),
                )
            ],
            usage=usage_of(last),
        ).model_dump()
