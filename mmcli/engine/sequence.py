"""Request state: what a request asks for, a running sequence's progress, and a finished one's
result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmcli.config import SamplingParams

CACHE_STEP = 256  # the KV cache's columns grow in steps of this many tokens


def cache_columns(tokens: int, max_len: int) -> int:
    """The KV-cache columns that hold `tokens` tokens: whole steps, never past max_len."""
    return min(max_len, -(-tokens // CACHE_STEP) * CACHE_STEP)


@dataclass(eq=False)
class Request:
    """One prompt about its vision inputs (images, and videos as one segment per temporal patch)."""

    key: str
    input_ids: list[int]
    rotary_position_ids: Any  # [3, L], opaque here
    rope_delta: int
    pixel_values: list[Any]  # one tensor per vision segment, in prompt order
    vision_grids: list[tuple[int, int, int]]  # (t, h, w) in patches, per vision segment
    sampling: SamplingParams
    stop_ids: frozenset[int]
    num_image_tokens: int = 0
    vision_hashes: list[str] = field(default_factory=list)  # content hash per segment: one encode
    task: str = ""
    prompt: str = ""  # the prompt as the model sees it, placeholders filled (for the record)
    # Requests of one group (an input's tasks) share their first prefix_len tokens.
    group: str | None = None
    prefix_len: int = 0
    constraint: Any = None  # a grammar.SequenceConstraint: the tokens this sequence may take
    # set from another thread (a server's client gone): the scheduler drops it at the next step
    cancelled: bool = False
    top_logprobs: int = 0  # the most likely tokens to report at each step, with their logprobs
    # what its sampled tokens are seeded by with `task` (default: `key`): a server's request
    # draws what `ask` draws for the same inputs, whatever its routing key
    seed_key: str | None = None

    @property
    def vision_patches(self) -> list[int]:
        return [t * h * w for t, h, w in self.vision_grids]

    def reach(self, max_len: int) -> int:
        """The tokens its KV-cache row may hold: the prompt and its output, within max_len."""
        prompt = len(self.input_ids)
        return max(min(max_len, prompt + self.sampling.max_new_tokens), prompt + 1)


@dataclass
class Sequence:
    """A request admitted to a slot (its KV-cache row), and the tokens it has generated."""

    request: Request
    slot: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # where asked
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.request.input_ids) + len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Finished:
    key: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an eos id) or "length" (max_new_tokens or the context limit)
    num_input_tokens: int
    num_image_tokens: int
    task: str = ""
    constraint: Any = None
    prompt: str = ""
    top_logprobs: list = field(default_factory=list)  # per token, where the request asked

    @classmethod
    def of(cls, seq: Sequence) -> Finished:
        req = seq.request
        return cls(
            req.key,
            seq.token_ids,
            seq.logprobs,
            seq.finish_reason,
            len(req.input_ids),
            req.num_image_tokens,
            req.task,
            req.constraint,
            req.prompt,
            seq.top_logprobs,
        )
