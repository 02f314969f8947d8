"""The Python API: `Labeler.from_pretrained(...)`, `.ask(images, question)`, `.label(items)`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from mmcli.model.checkpoint import (
    checkpoint_revision,
    load_weights,
    read_model_config,
    resolve_model,
    run_precision,
    torch_dtype,
)
from mmcli.compiled.graphs import CompiledGraphs, resolve_backend
from mmcli.config import Config, SamplingParams, check_vision_budget, load_config
from mmcli.engine.loop import Engine
from mmcli.engine.sequence import Request
from mmcli.engine.grammar import JsonGrammar
from mmcli.inputs.images import ImageProcessorConfig, image_processor_config
from mmcli.inputs.prefetch import NOT_READY, default_workers, prefetch
from mmcli.model.qwen3_vl import Qwen3VL
from mmcli.model.linear import held_bytes
from mmcli.api.result import Result
from mmcli.inputs.prompt import PromptBuilder, TextStream
from mmcli.inputs.requests import RequestBuilder
from mmcli.jobs.resume import label_settings
from mmcli.engine.runner import ModelRunner, pick_device
from mmcli.tasks import Task, finish, render_prompt, resolve_tasks
from mmcli.inputs.video import VideoSampling


def _stop_ids(path: Path, prompts: PromptBuilder) -> frozenset[int]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        eos_token = prompts.special_tokens.get("eos_token")
        ids = [prompts.tokenizer.token_to_id(eos_token)] if eos_token else []
    return frozenset(int(i) for i in ids if i is not None)


class Labeler:
    def __init__(self, path: Path, model: Qwen3VL, runner: ModelRunner, prompts: PromptBuilder,
                 image_cfg: ImageProcessorConfig, config: Config, precision: dict,
                 graphs: CompiledGraphs | None = None):
        self.path, self.model, self.runner, self.prompts = path, model, runner, prompts
        self.image_cfg, self.config, self.graphs = image_cfg, config, graphs
        self.model_name = config.model
        self.revision = checkpoint_revision(path)
        self.precision = {k: v for k, v in precision.items() if k != "loaded"}
        self.label_settings = label_settings(config, path, precision)
        self.stop_ids = _stop_ids(path, prompts)
        self.engine = Engine(runner, config)
        videos = VideoSampling.from_checkpoint(path, config.video, image_cfg.max_pixels)
        self.requests = RequestBuilder(prompts, image_cfg, config, (model.cfg.image_token_id, model.cfg.video_token_id),
                                       self.stop_ids, compiled=graphs is not None, video_sampling=videos)

    @classmethod
    def from_pretrained(cls, model: str | None = None, dtype: str | None = None, device: str | None = None,
                        config: Config | str | Path | None = None) -> Labeler:
        """Load a checkpoint (local directory or hub id). `config` is a Config or a YAML path."""
        cfg = config if isinstance(config, Config) else load_config(config)
        cfg = replace(cfg, model=model or cfg.model, dtype=dtype or cfg.dtype, device=device or cfg.device)
        backend = resolve_backend(cfg.compile.backend)
        path = resolve_model(cfg.model)
        model_cfg = read_model_config(path)
        dev = torch.device("neuron") if backend == "neuron" else pick_device(cfg.device)
        precision = run_precision(cfg.dtype, cfg.weights_dtype, cfg.quantize, model_cfg.torch_dtype, dev.type)
        dt = torch_dtype(precision["compute"])
        graphs = None if backend == "eager" else CompiledGraphs.for_run(backend, cfg, model_cfg, dt, dev)
        qwen = Qwen3VL.from_weights(model_cfg, load_weights(path, model_cfg, dt, torch_dtype(precision["loaded"])))
        runner = ModelRunner(qwen, dev, cfg, graphs)
        prompts = PromptBuilder.from_checkpoint(path, model_cfg.image_token_id)
        image_cfg = image_processor_config(path, cfg.image.min_pixels, cfg.image.max_pixels)
        check_vision_budget(cfg.vision.block_size, image_cfg.max_pixels, image_cfg.patch_size, image_cfg.merge_size)
        return cls(path, qwen, runner, prompts, image_cfg, cfg, precision, graphs)

    def sampling(self, **overrides) -> SamplingParams:
        """The configured sampling with these values replaced (None keeps the configured one)."""
        return replace(self.config.generation, **{k: v for k, v in overrides.items() if v is not None})

    def request(self, key: str, images: list, question: str, sampling: SamplingParams,
                videos: list = ()) -> tuple[Request, list[dict]]:
        """Decode and preprocess the images and videos and build the prompt; raises ImageError for a bad input."""
        prepared = self.requests.images(images, videos)
        return self.requests.build(key, prepared, question, sampling), prepared.infos

    def _finish(self, done, infos: list[dict], started: float, task: Task | None = None) -> Result:
        text = self.prompts.decode(done.token_ids)
        result = Result(done.key, text, done.token_ids, done.logprobs, done.finish_reason, done.num_input_tokens,
                        done.num_image_tokens, int((time.perf_counter() - started) * 1000), infos,
                        task=task.name if task else "")
        if task is None:
            return result
        if done.constraint is not None and not done.constraint.accepting:
            result.error = {"type": "ItemError", "message": f"the JSON answer did not close within max_new_tokens "
                            f"{task.sampling.max_new_tokens} (task {task.name})"}
            return result
        first = infos[0] if infos else {}
        try:
            result.fields = finish(task, text, first.get("width"), first.get("height"))
        except ValueError as e:
            result.error = {"type": "ItemError", "message": f"task {task.name}: {e}"}
        return result

    def tasks(self, tasks: list[str | Task] | None = None, prompt: str | None = None, **sampling) -> list[Task]:
        """Task objects for names (the settings' `tasks`), or the one plain task of `prompt` when none are named;
        sampling values given here override every task's."""
        if tasks is None:
            resolved = [Task("caption", prompt or self.config.prompt, "text", None, self.sampling(), None, "", "")]
        else:
            resolved = [t if isinstance(t, Task) else resolve_tasks(self.config, [t])[0] for t in tasks]
        overrides = {k: v for k, v in sampling.items() if v is not None}
        return [replace(t, sampling=replace(t.sampling, **overrides)) for t in resolved]

    def grammars(self, tasks: list[Task]) -> dict:
        """Each json task's schema compiled (once; a schema that cannot compile is a ConfigError naming it)."""
        eos = min(self.stop_ids) if self.stop_ids else 0
        return {t.name: JsonGrammar(t.name, t.schema, self.prompts.tokenizer.to_str(), eos)
                for t in tasks if t.output == "json"}

    def ask(self, images: list, question: str | None = None, on_text: Callable[[str], None] | None = None,
            task: str | Task | None = None, videos: list = (), **sampling) -> Result:
        """One answer about images (paths or PIL images) and videos (paths; a path in `images` with a video
        extension counts as one), to `question` or as `task` asks. `on_text` receives the answer's text piece by
        piece as it is generated (the pieces join to the result's text)."""
        started = time.perf_counter()
        (chosen,) = self.tasks([task] if task is not None else None, question, **sampling)
        prepared = self.requests.images(list(images), list(videos))
        inputs = [*images, *videos]
        path = inputs[0] if inputs and not isinstance(inputs[0], Image.Image) else None
        grammar = self.grammars([chosen]).get(chosen.name)
        asked = question or render_prompt(chosen, path)
        req = self.requests.build("ask", prepared, asked, chosen.sampling, task=chosen.name,
                                  constraint=grammar.start() if grammar else None)
        stream = TextStream(self.prompts) if on_text is not None else None
        on_token = (lambda key, token: on_text(stream.push(token))) if stream is not None else None
        if stream is not None and task is not None:
            on_text(chosen.prefix)  # the task's template around the answer, as its record's text has it
        done = next(iter(self.engine.generate([req], on_token)))
        if stream is not None:
            on_text(stream.finish() + (chosen.suffix if task is not None else ""))
        result = self._finish(done, prepared.infos, started, chosen if task is not None else None)
        result.prompt, result.sampling = asked, chosen.sampling.as_dict()
        return result

    def label(self, items: Iterable[tuple], prompt: str | None = None, tasks: list[str | Task] | None = None,
                **sampling) -> Iterator[Result]:
        """Label (key, image path) items, or (key, path, task names) to run only some tasks for an item; yields
        each Result (one per item and task, `.task` naming it) as soon as it is finished, errors included. Without
        `tasks`, one caption per item with `prompt`. An image's tasks share its decoding, its vision encoding and
        the prefill of their common prompt prefix."""
        items = list(items)
        seen: set[str] = set()
        for key, *_ in items:
            if key in seen:
                raise ValueError(f"caption: key {key!r} is given twice; keys name results and must be unique")
            seen.add(key)
        chosen = self.tasks(tasks, prompt, **sampling)
        by_name, grammars = {t.name: t for t in chosen}, self.grammars(chosen)
        started: dict[str, float] = {}
        infos: dict[str, list[dict]] = {}
        left: dict[str, int] = {}  # tasks still running per key: its entries go once the last one finishes
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
                if isinstance(outcome, Exception):  # a bad file, or anything else a worker raised: its records
                    names = item[2] if len(item) > 2 else list(by_name)
                    started.pop(item[0], None)
                    failed.extend(Result(item[0], error={"type": type(outcome).__name__, "message": str(outcome)},
                                         task=n if tasks is not None else "") for n in names)
                    continue
                reqs, infos[item[0]] = outcome
                left[item[0]] = len(reqs)
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

    def report_compile_cache(self) -> None:
        """With a compiled backend: say on stderr which configured buckets were not compiled ahead."""
        line = self.graphs.missing_report() if self.graphs is not None else None
        if line:
            print(f"mmcli: {line}", file=sys.stderr)

    def report_compile_use(self) -> None:
        """With a compiled backend: say on stderr how many buckets were loaded and compiled in this run."""
        if self.graphs is not None:
            print(f"mmcli: {self.graphs.use_report()}", file=sys.stderr)

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory as the runner holds them (packed or quantized copies included;
        a tied lm_head's weight is the embedding's, counted once)."""
        return held_bytes(self.model)
