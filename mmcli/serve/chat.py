"""A chat-completions request into the engine's requests, and the engine's finished sequences into
OpenAI's response: the conversation rendered by the checkpoint's chat template as `ask` renders
it, the media fetched under the server's rules, the sampling, the JSON grammar, the stop strings,
the log-probabilities."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from mmcli.config import SamplingParams
from mmcli.errors import ConfigError, ImageError, ItemError
from mmcli.inputs.prompt import PromptBuilder
from mmcli.inputs.requests import PreparedInputs
from mmcli.inputs.video import probe_video
from mmcli.serve.admission import DECODE_BYTES_PER_PIXEL, MediaBudget, image_pixels
from mmcli.serve.media import MediaPolicy
from mmcli.serve.protocol import APIError, ChatCompletionRequest
from mmcli.tasks import QUESTION_TASK

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler


@dataclass
class Limits:
    max_images: int = 16
    max_videos: int = 2
    max_body_bytes: int = 64 << 20
    max_queue: int = 64  # requests admitted and not yet started
    max_preparing: int = 4  # requests whose media are fetched and decoded at once
    max_media_bytes: int = 2 << 30  # what the requests being prepared may hold at once
    request_timeout: float = 600.0  # seconds from admission to the last token


@dataclass
class ChatJob:
    """One request's engine requests (one per choice, `n`) and what its response needs."""

    id: str
    model: str
    prompts: PromptBuilder  # the run's, thinking on or off as the request asks
    requests: list = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    images: int = 0
    video_frames: int = 0
    deadline: float = math.inf  # what its media may wait for room in the budget until


def build_job(
    labeler: Labeler,
    body: ChatCompletionRequest,
    policy: MediaPolicy,
    limits: Limits,
    key: str,
    served: str,
    budget: MediaBudget | None = None,
    deadline: float = math.inf,
    fresh_seed: bool = False,
) -> ChatJob:
    """The engine requests of `body`, each medium reserved in `budget` (waiting for room until
    `deadline`) before it is read; APIError(400) naming what cannot run. `fresh_seed`: a sampled
    request without a seed draws its own (a server's: two such requests may differ)."""
    check_supported(body)
    job = ChatJob(key, served, _prompts(labeler, body), stops=body.stops, logprobs=body.logprobs)
    job.deadline = deadline
    messages, refs = conversation(body, limits)
    grammar = _grammar(labeler, body, job.prompts.reasoning_end)
    sampling = sampling_of(labeler.config.generation, body, fresh_seed)
    prepared = _prepared(labeler, refs, policy, budget, job)
    for choice in range(body.n):
        try:
            request = labeler.chat_request(
                f"{key}-{choice}",
                prepared,
                messages,
                sampling=sampling,
                prompts=job.prompts,
                # seeded as `ask` is for the same question: the same sampled answer
                seed_key="ask" if choice == 0 else f"ask-{choice}",
                task=QUESTION_TASK,
                top_logprobs=body.top_logprobs or 0,
                constraint=grammar.start() if grammar is not None else None,
            )
        except ItemError as e:
            raise APIError(400, str(e), "messages", "context_length_exceeded") from None
        except TemplateError as e:  # the template's raise_exception: a conversation it refuses
            raise APIError(
                400, f"messages: the chat template refuses them ({e})", "messages"
            ) from None
        job.requests.append(request)
    return job


def _prepared(labeler: Labeler, refs: list[MediaRef], policy: MediaPolicy, budget, job: ChatJob):
    """The media fetched and decoded one at a time, in order, each reserving its bytes and its
    decoded size (from its header) in the media budget first and giving them back once it is
    patchified: a request holds one medium's reservation at a time, so none waits on itself."""
    prepared = PreparedInputs([], [], [], [])
    for ref in refs:
        with budget.hold(job.deadline) if budget else contextlib.nullcontext() as hold:
            received = policy.fetch(ref.url, ref.where, hold)
            if ref.kind == "video":
                frames, height, width = _probe(labeler, received, ref.where)
                job.video_frames += frames
                decoded = _video_bytes(labeler, height, width)
            else:
                job.images += 1
                decoded = image_pixels(received.data) * DECODE_BYTES_PER_PIXEL
            if hold is not None:
                hold.reserve(decoded, ref.where)
            try:
                prepared.extend(labeler.prepare_media([(ref.kind, received)]))
            except ImageError as e:
                raise APIError(400, str(e), "messages") from None
    return prepared


def _probe(labeler: Labeler, received, where: str) -> tuple[int, int, int]:
    try:
        return probe_video(received, labeler.video_sampling)
    except ImageError as e:
        raise APIError(400, f"{where}: {received.name}: {e}", where) from None


def _video_bytes(labeler: Labeler, height: int, width: int) -> int:
    """A video's decoding holds one full-size frame at a time and its frames resized to the
    run's budget over all of them (inputs/video.py)."""
    resized = labeler.video_sampling.max_pixels * 4
    return height * width * DECODE_BYTES_PER_PIXEL + resized


def check_supported(body: ChatCompletionRequest) -> None:
    """What mmcli does not implement, refused by name (never ignored)."""
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"{name}: not implemented by mmcli serve (see docs/serve.md)", name)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")


def _prompts(labeler: Labeler, body: ChatCompletionRequest):
    """The run's prompt builder, thinking as the request's chat_template_kwargs or
    reasoning_effort say (the server's --thinking by default)."""
    try:
        return labeler.prompt_builder(body.thinking)
    except ConfigError as e:
        name = "reasoning_effort" if body.chat_template_kwargs is None else "chat_template_kwargs"
        raise APIError(400, f"{name}: {e}", name) from None


@dataclass(frozen=True)
class MediaRef:
    """A medium a message names, not yet fetched."""

    kind: str  # "image" or "video"
    url: str
    where: str  # the part's place, for errors


def conversation(body: ChatCompletionRequest, limits: Limits) -> tuple[list, list[MediaRef]]:
    """(the template's messages, the media in their order); the counts are checked before
    anything is fetched."""
    messages, refs = [], []
    for m, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if message.content is None or isinstance(message.content, str):
            messages.append({"role": role, "content": message.content or ""})
            continue
        parts = []
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            kind = "image" if part.type == "image_url" else "video"
            if role != "user":
                raise APIError(400, f"{where}: media only in user messages", where)
            refs.append(MediaRef(kind, getattr(part, part.type).url, where))
            parts.append({"type": kind})
        messages.append({"role": role, "content": parts})
    for kind, most, flag in (("image", limits.max_images, "--max-images"),
                             ("video", limits.max_videos, "--max-videos")):  # fmt: skip
        count = sum(ref.kind == kind for ref in refs)
        if count > most:
            raise APIError(400, f"messages: {count} {kind}s, over {flag} {most}", "messages")
    return messages, refs


def sampling_of(
    base: SamplingParams, body: ChatCompletionRequest, fresh_seed: bool = False
) -> SamplingParams:
    """The server's generation settings with the request's values; without a seed, a fresh
    one where `fresh_seed` asks (else the settings' generation.seed)."""
    seed = body.seed
    if seed is None and fresh_seed:
        seed = secrets.randbits(63)
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": seed,
        "max_new_tokens": body.max_completion_tokens or body.max_tokens,
    }
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def _grammar(labeler: Labeler, body: ChatCompletionRequest, reasoning_end: int | None):
    """The JSON grammar a response_format asks for, compiled once per schema (None for text)."""
    form = body.response_format
    if form is None or form.type == "text":
        return None
    schema = {"type": "object"}
    if form.type == "json_schema":
        if form.json_schema is None:
            raise APIError(400, "response_format.json_schema: missing", "response_format")
        schema = form.json_schema.schema_
    try:
        return labeler.json_grammar(json.dumps(schema, sort_keys=True), reasoning_end)
    except ConfigError as e:  # "response_format: cannot be compiled to a grammar (...)"
        raise APIError(400, str(e), "response_format") from None


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in stops if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def choice_of(labeler: Labeler, job: ChatJob, index: int, done) -> dict:
    """One choice of the response, from a finished sequence."""
    reasoning, text, _ = job.prompts.split_reasoning(done.token_ids)
    text, stopped = cut_at_stop(text, job.stops)
    reason = "stop" if stopped or done.finish_reason in ("stop", "cancelled") else "length"
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    choice = {"index": index, "message": message, "finish_reason": reason, "logprobs": None}
    if job.logprobs:
        choice["logprobs"] = {"content": token_logprobs(labeler, done)}
    return choice


def token_logprobs(labeler: Labeler, done) -> list[dict]:
    """OpenAI's logprobs.content: each token's text, log-probability and bytes, and the most
    likely tokens at its step where the request asked for them."""
    tops = done.top_logprobs or [[] for _ in done.token_ids]
    return [
        {**_token(labeler, token_id, logprob), "top_logprobs": [_token(labeler, *t) for t in top]}
        for token_id, logprob, top in zip(done.token_ids, done.logprobs, tops)
    ]


def _token(labeler: Labeler, token_id: int, logprob: float) -> dict:
    piece = labeler.token_text(token_id)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def usage_of(finished: list) -> dict:
    prompt = finished[0].num_input_tokens if finished else 0
    completion = sum(len(done.token_ids) for done in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def response_of(labeler: Labeler, job: ChatJob, finished: list) -> dict:
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [choice_of(labeler, job, i, done) for i, done in enumerate(finished)],
        "usage": usage_of(finished),
    }
