"""A chat-completions request into the engine's requests, and the engine's finished sequences into
OpenAI's response: the conversation rendered by the checkpoint's chat template as `ask` renders
it, the media fetched under the server's rules, the sampling, the JSON grammar, the stop strings,
the log-probabilities."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

from mmcli.config import SamplingParams
from mmcli.errors import ConfigError, ImageError, ItemError
from mmcli.inputs.prompt import PromptBuilder
from mmcli.serve.media import MediaPolicy
from mmcli.serve.protocol import APIError, ChatCompletionRequest
from mmcli.tasks import QUESTION_TASK


@dataclass
class Limits:
    max_images: int = 16
    max_body_bytes: int = 64 << 20
    max_queue: int = 64


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


def build_job(
    labeler, body: ChatCompletionRequest, policy: MediaPolicy, limits: Limits, key: str, served: str
) -> ChatJob:
    """The engine requests of `body`; APIError(400) naming what cannot run."""
    check_supported(body)
    job = ChatJob(key, served, _prompts(labeler, body), stops=body.stops, logprobs=body.logprobs)
    messages, media = conversation(body, policy, limits)
    try:
        prepared = labeler.requests.prepare_in_order(media)
    except ImageError as e:
        raise APIError(400, str(e), "messages") from None
    grammar = _grammar(labeler, body, job.prompts.reasoning_end)
    sampling = sampling_of(labeler.config.generation, body)
    for choice in range(body.n):
        try:
            request = labeler.requests.build_messages(
                f"{key}-{choice}",
                prepared,
                messages,
                sampling,
                job.prompts,
                # seeded as `ask` is for the same question: the same sampled answer
                seed_key="ask" if choice == 0 else f"ask-{choice}",
                task=QUESTION_TASK,
                top_logprobs=body.top_logprobs or 0,
                constraint=grammar.start() if grammar is not None else None,
            )
        except ItemError as e:
            raise APIError(400, str(e), "messages", "context_length_exceeded") from None
        job.requests.append(request)
    return job


def check_supported(body: ChatCompletionRequest) -> None:
    """What mmcli does not implement, refused by name (never ignored)."""
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"{name}: not implemented by mmcli serve (see docs/serve.md)", name)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")


def _prompts(labeler, body: ChatCompletionRequest):
    """The run's prompt builder, thinking as the request's chat_template_kwargs say (the
    server's --thinking by default)."""
    kwargs = body.chat_template_kwargs
    if kwargs is None:
        return labeler.prompts
    try:
        return labeler.prompts.with_thinking(kwargs.enable_thinking)
    except ConfigError as e:
        raise APIError(
            400, f"chat_template_kwargs.enable_thinking: {e}", "chat_template_kwargs"
        ) from None


def conversation(body: ChatCompletionRequest, policy: MediaPolicy, limits: Limits):
    """(the template's messages, the media in their order as ("image" | "video", source)); the
    image count is checked before anything is fetched."""
    images = sum(
        part.type == "image_url"
        for message in body.messages
        if isinstance(message.content, list)
        for part in message.content
    )
    if images > limits.max_images:
        raise APIError(
            400, f"messages: {images} images, over --max-images {limits.max_images}", "messages"
        )
    messages, media = [], []
    for m, message in enumerate(body.messages):
        if message.content is None or isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content or ""})
            continue
        parts = []
        for p, part in enumerate(message.content):
            where = f"messages[{m}].content[{p}]"
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            kind = "image" if part.type == "image_url" else "video"
            if message.role != "user":
                raise APIError(400, f"{where}: media only in user messages", where)
            media.append((kind, policy.fetch(getattr(part, part.type).url, where)))
            parts.append({"type": kind})
        messages.append({"role": message.role, "content": parts})
    return messages, media


def sampling_of(base: SamplingParams, body: ChatCompletionRequest) -> SamplingParams:
    """The server's generation settings with the request's values."""
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "max_new_tokens": body.max_completion_tokens or body.max_tokens,
    }
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def _grammar(labeler, body: ChatCompletionRequest, reasoning_end: int | None):
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


def choice_of(labeler, job: ChatJob, index: int, done) -> dict:
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


def token_logprobs(labeler, done) -> list[dict]:
    """OpenAI's logprobs.content: each token's text, log-probability and bytes, and the most
    likely tokens at its step where the request asked for them."""
    tops = done.top_logprobs or [[] for _ in done.token_ids]
    return [
        {**_token(labeler, token_id, logprob), "top_logprobs": [_token(labeler, *t) for t in top]}
        for token_id, logprob, top in zip(done.token_ids, done.logprobs, tops)
    ]


def _token(labeler, token_id: int, logprob: float) -> dict:
    piece = labeler.prompts.tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def usage_of(finished: list) -> dict:
    prompt = finished[0].num_input_tokens if finished else 0
    completion = sum(len(done.token_ids) for done in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def response_of(labeler, job: ChatJob, finished: list) -> dict:
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [choice_of(labeler, job, i, done) for i, done in enumerate(finished)],
        "usage": usage_of(finished),
    }
