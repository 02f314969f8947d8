"""The Python API: `Captioner.from_pretrained(...)`, `.ask(images, question)`, `.caption(items)`."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from .checkpoint import (
    checkpoint_revision,
    load_weights,
    read_model_config,
    resolve_model,
    run_precision,
    torch_dtype,
)
from .compiled import CompiledGraphs, resolve_backend
from .config import Config, SamplingParams, check_vision_budget, load_config
from .engine import Engine, Request
from .errors import ImageError, ItemError
from .images import ImageProcessorConfig, image_processor_config
from .inputs import NOT_READY, default_workers, prefetch
from .model import Qwen3VL
from .model.linear import held_bytes
from .output import Result
from .positions import rope_index
from .preprocess import decode_image, preprocess
from .prompt import PromptBuilder, TextStream
from .resume import label_settings
from .runner import ModelRunner, pick_device


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


class Captioner:
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

    @classmethod
    def from_pretrained(cls, model: str | None = None, dtype: str | None = None, device: str | None = None,
                        config: Config | str | Path | None = None) -> Captioner:
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

    def request(self, key: str, images: list, question: str, sampling: SamplingParams) -> tuple[Request, list[dict]]:
        """Decode and preprocess the images and build the prompt; raises ImageError for a bad image."""
        pixels, grids, infos, hashes = [], [], [], []
        for image in images:
            if isinstance(image, Image.Image):
                rgb, note = image.convert("RGB"), None
            else:
                try:
                    decoded = decode_image(image, self.config.image.max_decode_pixels)
                except ImageError as e:
                    raise ImageError(f"{image}: {e}") from None
                rgb, note = decoded.image, decoded.note
            try:
                pv, grid = preprocess(rgb, self.image_cfg)
            except ImageError as e:
                raise ImageError(f"{image if not isinstance(image, Image.Image) else 'image'}: {e}") from None
            if pv.shape[0] > self.config.vision.block_size:  # only extreme aspect ratios under tiny budgets
                raise ImageError(f"{image}: {pv.shape[0]} patches do not fit vision.block_size "
                                 f"{self.config.vision.block_size}")
            pixels.append(pv)
            grids.append(grid)
            hashes.append(hashlib.blake2b(pv.numpy().tobytes(), digest_size=16).hexdigest())
            infos.append({"width": rgb.width, "height": rgb.height, "note": note})
        m2 = self.image_cfg.merge_size**2
        counts = [t * h * w // m2 for t, h, w in grids]
        ids = self.prompts.encode(question, counts)
        if len(ids) >= self.config.engine.max_len:
            raise ItemError(f"{key}: prompt of {len(ids)} tokens does not fit engine.max_len "
                            f"{self.config.engine.max_len}")
        largest = max(self.config.compile.prefill_buckets)
        if self.graphs is not None and len(ids) > largest:
            raise ItemError(f"{key}: prompt of {len(ids)} tokens is over the largest compile.prefill_buckets entry "
                            f"{largest}")
        rotary, delta = rope_index(ids, grids, self.model.cfg.image_token_id, self.image_cfg.merge_size)
        req = Request(key, ids, rotary, delta, pixels, grids, sampling, self.stop_ids, sum(counts), hashes)
        return req, infos

    def _finish(self, done, infos: list[dict], started: float) -> Result:
        return Result(done.key, self.prompts.decode(done.token_ids), done.token_ids, done.logprobs,
                      done.finish_reason, done.num_input_tokens, done.num_image_tokens,
                      int((time.perf_counter() - started) * 1000), infos)

    def ask(self, images: list, question: str, on_text: Callable[[str], None] | None = None, **sampling) -> Result:
        """One answer about one or more images (paths or PIL images). `on_text` receives the answer's text piece
        by piece as it is generated (the pieces join to the result's text)."""
        started = time.perf_counter()
        req, infos = self.request("ask", list(images), question, self.sampling(**sampling))
        stream = TextStream(self.prompts) if on_text is not None else None
        on_token = (lambda key, token: on_text(stream.push(token))) if stream is not None else None
        done = next(iter(self.engine.generate([req], on_token)))
        if stream is not None:
            on_text(stream.finish())
        return self._finish(done, infos, started)

    def caption(self, items: Iterable[tuple[str, str | Path]], prompt: str | None = None,
                **sampling) -> Iterator[Result]:
        """Caption (key, image path) items; yields each Result as soon as it is finished (errors included)."""
        items = list(items)
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise ValueError(f"caption: key {key!r} is given twice; keys name results and must be unique")
            seen.add(key)
        params = self.sampling(**sampling)
        question = prompt or self.config.prompt
        started: dict[str, float] = {}
        infos: dict[str, list[dict]] = {}
        failed: list[Result] = []

        def prepare(item: tuple[str, str | Path]):
            started[item[0]] = time.perf_counter()
            return self.request(item[0], [item[1]], question, params)

        def requests() -> Iterator[Request | None]:
            workers = default_workers(self.config.inputs.workers)
            depth = max(self.config.engine.max_seqs, self.config.vision.lookahead) + workers
            for ready in prefetch(items, prepare, workers, depth):
                if ready is NOT_READY:
                    yield None  # the engine goes on with what it has
                    continue
                (key, _), outcome = ready
                if isinstance(outcome, Exception):  # a bad file, or anything else a worker raised: its record
                    failed.append(Result(key, error={"type": type(outcome).__name__, "message": str(outcome)}))
                    continue
                req, infos[key] = outcome
                yield req

        for done in self.engine.generate(requests()):
            while failed:
                yield failed.pop(0)
            yield self._finish(done, infos.pop(done.key), started.pop(done.key))
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
