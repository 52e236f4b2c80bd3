"""OpenAI-compatible request/response models and the OpenAI-style error body."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

# Per-request bounds (the schema declares them, and pydantic enforces exactly what it declares).
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256


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
                "code": self.code,
            }
        }

    def to_bytes(self) -> bytes:
        # ensure_ascii: messages may echo client input, which can hold lone surrogates
        return json.dumps(self.body(), ensure_ascii=True).encode()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


_INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=_INT32)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
_STOP_RULE = (
    f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings, "
    f"each at most {MAX_STOP_CHARS} characters"
)
_PROMPT_RULE = (
    "prompt must be a non-empty string, a non-empty list of token ids (0 <= id < 2^31), or a list "
    "holding exactly one of those (batched prompts are not supported)"
)


def _explained(value: Any, handler: ValidatorFunctionWrapHandler, rule: str) -> Any:
    """Run the field's own validation; on failure, one sentence naming the whole rule instead of
    pydantic's error for whichever union member it tried first."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(rule) from None


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
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
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

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_rule(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _explained(value, handler, _STOP_RULE)

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
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="preferred over max_tokens when both are set"
    )


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    ) = Field(description="a string, a list of token ids, or a list holding exactly one of those")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_rule(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _explained(value, handler, _PROMPT_RULE)

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


class SpecUsage(BaseModel):
    rounds: int = 0
    draft_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0


FinishReason = Literal["stop", "length"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the prefix cache: their prefill was skipped


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
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
