"""OpenAI-compatible request/response models and the OpenAI-style error body."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error that becomes ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


_INT32 = 2**31 - 1


class _SamplingFields(BaseModel):
    # strict: a string where a number belongs (or 1.0 where an integer belongs) is a 400, not
    # silently coerced; unknown fields are ignored, as OpenAI does.
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=_INT32, description="0 or -1: disabled")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_INT32)]] | None = None
    n: int | None = Field(
        default=1,
        description="number of choices: only 1 is supported",
        json_schema_extra={"minimum": 1, "maximum": 1},
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = False

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError(
                f"n={n} is not supported: this server returns exactly one choice per "
                "request (send n=1 or omit it, and send several requests instead)"
            )
        return n

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="preferred over max_tokens when both are set"
    )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of token ids, or a list holding exactly one of those"
    )


class SpecUsage(BaseModel):
    rounds: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0


FinishReason = Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec: SpecUsage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dspark-server"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
