"""The Python API: `Labeler.from_pretrained(...)`, `.ask(inputs, question)`, `.label(items)`."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from mmcli.api.loader import Loaded, Run, load, resolve_run
from mmcli.api.result import Result
from mmcli.config import Config, SamplingParams, load_config
from mmcli.engine.grammar import JsonGrammar, compile_grammars
from mmcli.engine.loop import Engine
from mmcli.engine.sequence import Finished, Request
from mmcli.inputs.placeholders import render_prompt
from mmcli.inputs.prefetch import NOT_READY, default_workers, prefetch
from mmcli.inputs.prompt import PromptBuilder, TextStream
from mmcli.inputs.requests import PreparedInputs, RequestBuilder
from mmcli.inputs.video import VideoSampling
from mmcli.models.registry import family_of
from mmcli.tasks import Task, decide_sampling, finish, question_task, resolve_tasks
from mmcli.weights.hub import snapshot_revision
from mmcli.weights.precision import Precision

if TYPE_CHECKING:
    from mmcli.compiled.graphs import CompiledGraphs
    from mmcli.kernels.plan import KernelPlan

JSON_GRAMMARS_KEPT = 64  # compiled schemas a labeler keeps (least recently used dropped)


class Labeler:
    """A loaded checkpoint that answers questions about images and videos and labels items with
    tasks (text, JSON under a schema, boxes)."""

    def __init__(self, loaded: Loaded):
        # what was loaded and the run it was loaded for (settings, paths, precision), held as made
        self.loaded, self.run = loaded, loaded.run
        self.model, self.runner, self.prompts = loaded.model, loaded.runner, loaded.prompts
        self.revision = snapshot_revision(self.run.path)
        self.engine = Engine(self.runner, self.config)
        # (schema text, reasoning end) -> JsonGrammar: a server's response formats, the latest kept
        self._json_grammars: OrderedDict = OrderedDict()
        visual_ids = (self.model.cfg.image_token_id, self.model.cfg.video_token_id)
        self.requests = RequestBuilder(
            self.prompts,
            self.run.image_cfg,
            self.config,
            visual_ids,
            loaded.stop_ids,
            compiled=loaded.graphs is not None,
            rope_index=family_of(self.model.cfg).rope_index,
            video_sampling=loaded.video_sampling,
        )

    @property
    def config(self) -> Config:
        return self.run.config

    @property
    def precision(self) -> Precision:
        return self.run.precision

    @property
    def graphs(self) -> CompiledGraphs | None:
        return self.loaded.graphs

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.loaded.stop_ids

    @property
    def kernel_plan(self) -> KernelPlan:
        return self.loaded.kernel_plan

    @property
    def model_name(self) -> str:
        return self.run.config.model

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        config: Config | str | Path | None = None,
    ) -> Labeler:
        """Load a checkpoint (local directory or hub id). `config` is a Config or a YAML path."""
        cfg = config if isinstance(config, Config) else load_config(config)
        cfg = replace(
            cfg, model=model or cfg.model, dtype=dtype or cfg.dtype, device=device or cfg.device
        )
        return cls.from_run(resolve_run(cfg))

    @classmethod
    def from_run(cls, run: Run) -> Labeler:
        """Load a run resolved before (api.loader.resolve_run): its configs are not read again."""
        return cls(load(run))

    def sampling(self, **given) -> SamplingParams:
        """The configured sampling with these values replaced (None keeps the configured one)."""
        return decide_sampling(self.config.generation, {}, given)

    def request(
        self, key: str, images: list, question: str, sampling: SamplingParams, videos: list = ()
    ) -> tuple[Request, list[dict]]:
        """Decode and preprocess the images and videos and build the prompt; raises ImageError
        for a bad input."""
        prepared = self.requests.prepare(images, videos)
        return self.requests.build(key, prepared, question, sampling), prepared.infos

    def _finish(self, done, infos: list[dict], started: float, task: Task | None = None) -> Result:
        reasoning, text, answered = self.prompts.split_reasoning(done.token_ids)
        result = Result(
            key=done.key,
            text=text,
            reasoning=reasoning,
            token_ids=done.token_ids,
            logprobs=done.logprobs,
            finish_reason=done.finish_reason,
            num_input_tokens=done.num_input_tokens,
            num_image_tokens=done.num_image_tokens,
            latency_ms=int((time.perf_counter() - started) * 1000),
            images=infos,
            task=task.name if task else "",
            prompt=done.prompt,
        )
        if not answered:
            return result.fail(
                f"the reasoning did not end within {len(done.token_ids)} tokens "
                "(no answer after it; raise max_new_tokens)"
                if done.finish_reason == "length"
                else "the model stopped inside its reasoning (no answer after it)"
            )
        if task is None:
            return result
        if done.constraint is not None and not done.constraint.accepting:
            return result.fail(
                f"the JSON answer did not close within max_new_tokens "
                f"{task.sampling.max_new_tokens} (task {task.name})"
            )
        first = infos[0] if infos else {}
        try:
            result.fields = finish(task, text, first.get("width"), first.get("height"))
        except ValueError as e:
            result.fail(f"task {task.name}: {e}")
        return result

    def tasks(
        self, tasks: list[str | Task] | None = None, prompt: str | None = None, **sampling
    ) -> list[Task]:
        """Tasks by name (the settings' `tasks`) or as given, or the one plain task of `prompt`."""
        if tasks is None:
            return [question_task(self.config, prompt, sampling)]
        return resolve_tasks(self.config, tasks, sampling)

    # What a server builds its requests from and runs them through (mmcli/serve/): the run's
    # prompt builder, its media prepared in order, a conversation as a request, the engine.

    def prompt_builder(self, thinking: bool | None = None) -> PromptBuilder:
        """The run's prompt builder, or one with thinking on or off (a ConfigError where the
        template has no switch)."""
        return self.prompts if thinking is None else self.prompts.with_thinking(thinking)

    @property
    def video_sampling(self) -> VideoSampling:
        return self.requests.video_sampling

    def prepare_media(self, media: list[tuple[str, object]]) -> PreparedInputs:
        """("image" or "video", its bytes as received) decoded and preprocessed, in order."""
        return self.requests.prepare_in_order(media)

    def chat_request(
        self, key: str, prepared: PreparedInputs, messages: list, **options
    ) -> Request:
        """A conversation over prepared media as one engine request (RequestBuilder's
        build_messages: sampling, the prompt builder, seed key, task, constraint)."""
        return self.requests.build_messages(key, prepared, messages, **options)

    def generate(
        self, requests: Iterable[Request | None], on_token: Callable[[str, int], None] | None = None
    ) -> Iterator[Finished]:
        """The engine over `requests` (None: none ready yet), each sequence as it finishes."""
        return self.engine.generate(requests, on_token)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included."""
        return self.prompts.tokenizer.decode([token_id], skip_special_tokens=False)

    def json_grammar(self, schema: str, reasoning_end: int | None, where: str = "response_format"):
        """A JSON schema (its JSON text) compiled against the tokenizer, once per schema and
        reasoning end (thinking: the schema constrains what follows it): each `start()` of it
        constrains one sequence; a ConfigError naming `where` if it cannot."""
        key = (schema, reasoning_end)
        if key in self._json_grammars:
            self._json_grammars.move_to_end(key)
            return self._json_grammars[key]
        eos = min(self.loaded.stop_ids) if self.loaded.stop_ids else 0
        tokenizer = self.prompts.tokenizer.to_str()
        grammar = JsonGrammar("", json.loads(schema), tokenizer, eos, reasoning_end, where)
        self._json_grammars[key] = grammar
        if len(self._json_grammars) > JSON_GRAMMARS_KEPT:  # a server's clients send any number
            self._json_grammars.popitem(last=False)
        return grammar

    def grammars(self, tasks: list[Task]) -> dict:
        return compile_grammars(
            tasks, self.prompts.tokenizer.to_str(), self.loaded.stop_ids, self.prompts.reasoning_end
        )

    def ask(
        self,
        images: list,
        question: str | None = None,
        on_text: Callable[[str], None] | None = None,
        task: str | Task | None = None,
        videos: list = (),
        **sampling,
    ) -> Result:
        """One answer about images (paths or PIL images) and videos (paths; a path in `images`
        with a video extension counts as one), to `question` or as `task` asks. `on_text`
        receives the answer's text piece by piece as it is generated (the pieces join to the
        result's text)."""
        started = time.perf_counter()
        (chosen,) = self.tasks([task] if task is not None else None, question, **sampling)
        prepared = self.requests.prepare(list(images), list(videos))
        inputs = [*images, *videos]
        path = inputs[0] if inputs and not isinstance(inputs[0], Image.Image) else None
        grammar = self.grammars([chosen]).get(chosen.name)
        asked = question or render_prompt(chosen, path)
        req = self.requests.build(
            "ask",
            prepared,
            asked,
            chosen.sampling,
            task=chosen.name,
            prompt=asked,
            constraint=grammar.start() if grammar else None,
        )
        stream = TextStream(self.prompts) if on_text is not None else None
        on_token = (lambda key, token: on_text(stream.push(token))) if stream is not None else None
        if stream is not None and task is not None:
            # the task's template around the answer, as its record's text has it
            on_text(chosen.prefix)
        done = next(iter(self.engine.generate([req], on_token)))
        if stream is not None:
            on_text(stream.finish() + (chosen.suffix if task is not None else ""))
        result = self._finish(done, prepared.infos, started, chosen if task is not None else None)
        result.prompt, result.sampling = asked, chosen.sampling.as_dict()
        return result

    def label(
        self,
        items: Iterable[tuple],
        prompt: str | None = None,
        tasks: list[str | Task] | None = None,
        **sampling,
    ) -> Iterator[Result]:
        """Label (key, image path) items, or (key, path, task names) to run only some tasks for
        an item; yields each Result (one per item and task, `.task` naming it) as soon as it is
        finished, errors included. Without `tasks`, one caption per item with `prompt`. An
        image's tasks share its decoding, its vision encoding and the prefill of their common
        prompt prefix."""
        items = _unique_keys(items)
        chosen = self.tasks(tasks, prompt, **sampling)
        by_name, grammars = {t.name: t for t in chosen}, self.grammars(chosen)
        started: dict[str, float] = {}
        infos: dict[str, list[dict]] = {}
        # tasks still running per key: its entries go once the last one finishes
        left: dict[str, int] = {}
        failed: list[Result] = []

        def prepare(item: tuple):
            key, path, names = item[0], item[1], item[2] if len(item) > 2 else list(by_name)
            started[key] = time.perf_counter()
            return self.requests.for_tasks(key, path, [by_name[n] for n in names], grammars)

        def requests() -> Iterator[Request | None]:
            workers = default_workers(self.config.inputs.workers)
            depth = max(self.config.engine.max_seqs, self.config.vision.lookahead) + workers
            for ready in prefetch(items, prepare, workers, depth):
                if ready is NOT_READY:
                    yield None  # the engine goes on with what it has
                    continue
                item, outcome = ready
                names = item[2] if len(item) > 2 else list(by_name)
                if isinstance(outcome, Exception):  # a bad file, or anything a worker raised
                    outcome = [], [], {n: outcome for n in names}
                reqs, item_infos, failures = outcome
                failed.extend(
                    _failure(item[0], by_name[n], e, item_infos, tasks is not None)
                    for n, e in failures.items()
                )
                if not reqs:
                    started.pop(item[0], None)
                    continue
                infos[item[0]], left[item[0]] = item_infos, len(reqs)
                yield from reqs

        for done in self.engine.generate(requests()):
            while failed:
                yield failed.pop(0)
            task = by_name[done.task] if tasks is not None else None
            result = self._finish(done, infos[done.key], started[done.key], task)
            left[done.key] -= 1
            if not left[done.key]:
                del left[done.key], infos[done.key], started[done.key]
            yield result
        yield from failed

    def compile_cache_report(self) -> str | None:
        """With a compiled backend: which configured buckets were not compiled ahead."""
        return self.graphs.missing_report() if self.graphs is not None else None

    def prepared_weights_report(self) -> str | None:
        """With `quantize: int8` or `int4` and the cache: where the prepared weights are, once the
        file this run writes (in a thread, while it runs) is whole or has failed."""
        return self.loaded.prepared.written() if self.loaded.prepared is not None else None

    @property
    def kernels(self) -> str:
        """The kernels this run chose, as its load line says them (with the prepared weights'
        status where it uses them)."""
        line, prepared = self.kernel_plan.summary(), self.loaded.prepared
        return f"{line}; {prepared.described()}" if prepared is not None else line

    def compile_use_report(self) -> str | None:
        """With a compiled backend: how many buckets were loaded and compiled in this run."""
        return self.graphs.use_report() if self.graphs is not None else None

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory as the runner holds them (packed or quantized
        copies included; a tied lm_head's weight is the embedding's, counted once)."""
        from mmcli.weights.loader import held_bytes

        return held_bytes(self.model)


def _unique_keys(items: Iterable[tuple]) -> list[tuple]:
    items = list(items)
    seen: set[str] = set()
    for key, *_ in items:
        if key in seen:
            raise ValueError(
                f"caption: key {key!r} is given twice; keys name results and must be unique"
            )
        seen.add(key)
    return items


def _failure(key: str, task: Task, error: Exception, infos: list[dict], named: bool) -> Result:
    """The result of a task that failed before it ran: its prompt as written, the error."""
    return Result.failed(
        key, error, images=infos, task=task.name if named else "", prompt=task.prompt
    )
