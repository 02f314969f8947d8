"""What the API gives back for one item and task: the answer, its tokens, timing and inputs, or
the error."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Result:
    key: str
    text: str = ""
    reasoning: str | None = None  # thinking mode: the reasoning before the answer in `text`
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_image_tokens: int = 0
    latency_ms: int = 0
    images: list[dict] = field(default_factory=list)  # width, height, note per input image
    error: dict | None = None  # {"type", "message"} when the item failed
    task: str = ""  # the task's name, when the item ran tasks
    prompt: str = ""  # the question asked (a task's prompt with its placeholders filled)
    sampling: dict = field(default_factory=dict)  # the sampling it was answered with
    # the task's record fields: text as templated, json, boxes
    fields: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, key: str, error: Exception, **fields) -> Result:
        """The result of an item (or one of its tasks) that failed with `error`."""
        return cls(key, **fields).fail(str(error), type(error).__name__)

    def fail(self, message: str, kind: str = "ItemError") -> Result:
        """This result as failed: the error's type and its one-line message."""
        self.error = {"type": kind, "message": message}
        return self
