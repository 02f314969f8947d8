"""The OpenAI chat-completions request as mmcli serves it, declared with pydantic: what a body may
hold, checked before any work. Fields OpenAI defines that mmcli does not implement are refused
with a 400 naming them (`UNSUPPORTED`); a top-level field nobody defines is ignored and named in
the log, as vLLM does (clients send their own extensions); within a message, nothing unknown
passes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}  # Retry-After on a 429 or 503

    @property
    def kind(self) -> str:
        """OpenAI's error type for this status."""
        if self.status in ERROR_TYPES:
            return ERROR_TYPES[self.status]
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MediaURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(Strict):
    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None

    @model_validator(mode="after")
    def _matches_type(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.type!r} part needs its {self.type!r} field")
        return self


class Message(Strict):
    # `developer` is OpenAI's newer name for `system`; the template sees `system`
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class JsonSchemaFormat(Strict):
    name: str = "answer"
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class ChatTemplateKwargs(Strict):
    enable_thinking: bool = False


# OpenAI's fields mmcli does not implement: given with a value other than this one, a 400
UNSUPPORTED = {
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "service_tier": None,
    "parallel_tool_calls": None,
}


class ChatCompletionRequest(Strict):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    # a default, not default_factory=list: pydantic reads a builtin factory's signature at
    # every request (0.4 ms, half of what `mmcli batch` spent on a failing line)
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    min_p: float | None = Field(default=None, ge=0, le=1)
    # Qwen3.5's thinking: "none" or "minimal" off, "low", "medium" or "high" on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: ChatTemplateKwargs | None = None
    user: str | None = None  # an end-user id: accepted, not used
    store: bool | None = None
    metadata: dict | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list | None = None
    prediction: dict | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data, handler):
        request = handler(data)
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()} | set(
                cls.model_fields
            )
            request._ignored = tuple(sorted(k for k in data if k not in known))
        return request

    @property
    def ignored(self) -> list[str]:
        """The top-level fields the body held that no one defines (ignored, as vLLM does)."""
        return list(self._ignored)

    @property
    def thinking(self) -> bool | None:
        """Thinking as the request asks it (chat_template_kwargs wins over reasoning_effort);
        None: the server's setting."""
        if self.chat_template_kwargs is not None:
            return self.chat_template_kwargs.enable_thinking
        if self.reasoning_effort is not None:
            return self.reasoning_effort not in ("none", "minimal")
        return None

    def unsupported(self) -> str | None:
        """The first field given that mmcli does not implement, if any."""
        for name, allowed in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value != allowed:
                return name
        return None

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]
