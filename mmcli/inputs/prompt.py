"""Prompts: the checkpoint's chat template in jinja2's sandbox, `tokenizers` BPE, image and video
pad expansion."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mmcli.errors import CheckpointError, ConfigError, ItemError

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD, VISION_START, VISION_END = "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
VIDEO_SPAN = VISION_START + VIDEO_PAD + VISION_END
THINK_END = "</think>"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not expect
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def load_chat_template(path: Path) -> str:
    """chat_template.jinja, chat_template.json, or tokenizer_config.json's chat_template, in that
    order."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            template = json.loads(file.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
    raise CheckpointError(f"{path}: no chat template (chat_template.jinja or chat_template.json)")


@dataclass
class PromptBuilder:
    """Renders messages with the checkpoint's template and tokenizes them, expanding image
    placeholders."""

    tokenizer: Tokenizer
    template: jinja2.Template
    image_token_id: int
    special_tokens: dict
    # thinking mode on: the template opens a reasoning block, which the model closes with
    # `reasoning_end` before its answer
    thinking: bool = False
    reasoning_end: int | None = None

    @classmethod
    def from_checkpoint(
        cls, path: Path, image_token_id: int, thinking: bool = False
    ) -> PromptBuilder:
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path}: tokenizer.json is missing")
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(
            raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt)
        )
        try:
            template = env.from_string(load_chat_template(path))
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"{path}: chat template does not parse ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
        if tokenizer.token_to_id(IMAGE_PAD) != image_token_id:
            raise CheckpointError(
                f"{path}: tokenizer id of {IMAGE_PAD} is {tokenizer.token_to_id(IMAGE_PAD)}, "
                f"config.json says image_token_id {image_token_id}"
            )
        end = tokenizer.token_to_id(THINK_END) if thinking else None
        if thinking and end is None:
            raise ConfigError(
                f"thinking: true needs a model that reasons in <think> blocks (Qwen3.5); the "
                f"tokenizer of {path} has no {THINK_END} token"
            )
        return cls(tokenizer, template, image_token_id, special, thinking, end)

    def with_thinking(self, thinking: bool) -> PromptBuilder:
        """This builder with thinking mode on or off (a server's request chooses); ConfigError
        where the model has no reasoning block to open."""
        if thinking == self.thinking:
            return self
        end = self.tokenizer.token_to_id(THINK_END) if thinking else None
        if thinking and end is None:
            raise ConfigError(
                f"thinking needs a model that reasons in <think> blocks (Qwen3.5); "
                f"this tokenizer has no {THINK_END} token"
            )
        return replace(self, thinking=thinking, reasoning_end=end)

    def render(self, question: str, kinds: list[str]) -> str:
        """The chat template over one user turn: the inputs ("image" or "video", in order), then
        the question."""
        return self.render_messages([user_turn(question, kinds)])

    def render_messages(self, messages: list[dict]) -> str:
        """The chat template over a conversation: messages of roles system, user and assistant,
        each's content a string or parts ({"type": "text", "text": ...}, {"type": "image"},
        {"type": "video"}), and the assistant's turn opened."""
        return self.template.render(
            messages=messages,
            add_generation_prompt=True,
            enable_thinking=self.thinking,
            **self.special_tokens,
        )

    def encode(self, question: str, layout: list) -> list[int]:
        """Token ids of one user turn about these inputs: the inputs in order (an image or a
        video per `layout` entry), then the question."""
        kinds = ["video" if isinstance(e, list) else "image" for e in layout]
        return self.encode_messages([user_turn(question, kinds)], layout)

    def encode_messages(self, messages: list[dict], layout: list) -> list[int]:
        """Token ids of a conversation whose image and video parts are, in order, the inputs of
        `layout`: per input an image's token count, or a video's [(seconds, tokens)] per temporal
        patch. An image's `<|image_pad|>` is repeated to its count; a video's
        `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal patch, "<t seconds>"
        and its own vision start, pads and end (as Qwen3-VL's processor expands it; the time
        formatted with one decimal)."""
        videos = [entry for entry in layout if isinstance(entry, list)]
        images = [entry for entry in layout if not isinstance(entry, list)]
        parts = self.render_messages(messages).split(VIDEO_SPAN)
        text = parts[0]
        for groups, part in zip(videos, parts[1:]):
            text += "".join(f"<{seconds:.1f} seconds>{VIDEO_SPAN}" for seconds, _ in groups) + part
        # spans in the question: the check
        text += "".join(VIDEO_SPAN + part for part in parts[len(videos) + 1 :])
        ids = self.tokenizer.encode(text).ids
        video_id = self.tokenizer.token_to_id(VIDEO_PAD)
        found = (
            sum(1 for i in ids if i == self.image_token_id),
            sum(1 for i in ids if i == video_id),
        )
        expected = len(images), sum(len(groups) for groups in videos)
        if found != expected:
            raise ItemError(
                f"the prompt holds {found[0]} image and {found[1]} video placeholders for "
                f"{expected[0]} images and {expected[1]} video frame groups (does the question "
                f"contain {IMAGE_PAD} or {VIDEO_PAD}?)"
            )
        image_counts = iter(images)
        group_counts = iter(tokens for groups in videos for _, tokens in groups)
        out: list[int] = []
        for i in ids:
            out.extend(
                [i] * next(image_counts)
                if i == self.image_token_id
                else [i] * next(group_counts)
                if i == video_id
                else (i,)
            )
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def split_reasoning(self, ids: list[int]) -> tuple[str | None, str, bool]:
        """(reasoning, answer, whether the reasoning ended) of generated ids: all answer when
        thinking is off; with it on, what precedes `reasoning_end` is the reasoning."""
        if self.reasoning_end is None:
            return None, self.decode(ids), True
        if self.reasoning_end not in ids:
            return self.decode(ids).strip(), "", False
        cut = ids.index(self.reasoning_end)
        return self.decode(ids[:cut]).strip(), self.decode(ids[cut + 1 :]).lstrip(), True


def user_turn(question: str, kinds: list[str]) -> dict:
    """One user message: the inputs ("image" or "video", in order), then the question."""
    content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": question}]
    return {"role": "user", "content": content}


class TextStream:
    """Text of a growing token sequence, piece by piece, as it is generated: each piece is what
    the decoded text gained, held back while it ends in an incomplete UTF-8 character (a
    character split over two byte-level tokens is emitted once, whole). The pieces join to
    `decode(all ids)`; in thinking mode, to the answer after the reasoning (as `split_reasoning`
    gives it)."""

    def __init__(self, prompts: PromptBuilder):
        self.prompts, self.ids, self.emitted = prompts, [], ""
        self.answering = prompts.reasoning_end is None

    def _text(self) -> str:
        text = self.prompts.decode(self.ids)
        return text if self.prompts.reasoning_end is None else text.lstrip()

    def push(self, token_id: int) -> str:
        if not self.answering:  # the reasoning is not streamed
            self.answering = token_id == self.prompts.reasoning_end
            return ""
        self.ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # an unfinished character (or a re-spelled tail): wait for the next token
        piece, self.emitted = text[len(self.emitted) :], text
        return piece

    def finish(self) -> str:
        """What is left once generation stops (a character never completed stays as the decoder
        spells it)."""
        text = self._text()
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
