"""Settings: YAML -> frozen dataclasses. Precedence: CLI > file > these built-in defaults.

configs/default.yaml documents every key with the same values; a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mmcli.errors import ConfigError
from mmcli.models.config import DEFAULT_MODEL, QWEN_MERGE_SIZE, QWEN_PATCH_SIZE
from mmcli.paths import mmcli_cache


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen, and how many: the `generation` settings, and each
    request's own."""

    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    # OpenAI's penalties, over the tokens generated so far (vLLM's reading): each logit minus
    # presence_penalty where its token was generated and frequency_penalty times its count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one

    def __post_init__(self):
        _refuse(
            self,
            "generation.",
            [
                ("max_new_tokens", self.max_new_tokens >= 1, "at least 1"),
                ("temperature", self.temperature >= 0, "0 or more"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                ("top_k", self.top_k >= 0, "0 or more"),
                ("repetition_penalty", self.repetition_penalty > 0, "above 0"),
                ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ],
        )

    @property
    def penalized(self) -> bool:
        """Whether a token's choice reads the sequence's history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def as_dict(self) -> dict:
        """The settings as records and resume keys hold them: the penalties and min_p only where
        set, so that records written before they existed stay current."""
        kept = dataclasses.asdict(self)
        for name in ("presence_penalty", "frequency_penalty", "min_p"):
            if kept[name] == 0.0:
                del kept[name]
        return kept


PLACEHOLDERS = ("filename", "stem", "folder", "sidecar")  # filled per input in a task prompt
# `{name}` is a placeholder; `{{name}}` (any name, doubled) is the literal text `{name}`; every
# other character, braces included, is the prompt as written.
PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
OUTPUTS = ("text", "json", "boxes")


@dataclass(frozen=True)
class TaskConfig:
    """One label to make per image (see mmcli/tasks.py for the presets and the placeholders)."""

    # the question; placeholders {filename} {stem} {folder} {sidecar}; "" (caption): `prompt`
    prompt: str = ""
    # text, json (with `schema`), or boxes (Qwen3-VL's bbox_2d JSON, in pixels)
    output: str = "text"
    # JSON Schema the answer must match (output json): decoding is constrained to it
    schema: dict | None = None
    max_new_tokens: int | None = None  # None: generation.max_new_tokens
    temperature: float | None = None  # None: generation.temperature
    # this task's sidecar extension (--sidecar applies to the first task)
    sidecar: str | None = None
    prefix: str = ""  # put before the answer in `text` and the sidecar (a trigger word, say)
    suffix: str = ""  # put after it


PRESET_TASKS = {
    "caption": TaskConfig(),
    "detailed": TaskConfig(
        prompt="Describe this image in detail: the subjects, what they do, the setting, the "
        "colours, the light and the composition.",
        max_new_tokens=256,
    ),
    "tags": TaskConfig(
        prompt="List the main subjects, objects and attributes in this image as short "
        "comma-separated tags.",
        max_new_tokens=64,
    ),
    "ocr": TaskConfig(
        prompt="Read all the text in this image exactly as written. Answer with the text only.",
        max_new_tokens=256,
    ),
    "detect": TaskConfig(
        prompt="Locate every distinct object in this image. Answer in JSON: a list of "
        '{"bbox_2d": [x1, y1, x2, y2], "label": "name"}.',
        output="boxes",
        max_new_tokens=512,
    ),
}


@dataclass(frozen=True)
class ImageConfig:
    min_pixels: int | None = None  # None: the checkpoint's preprocessor_config.json
    max_pixels: int = 1_310_720  # cap on the checkpoint's own max_pixels (1280 visual tokens)
    # refuse larger files before decoding (decompression bombs)
    max_decode_pixels: int = 134_217_728


@dataclass(frozen=True)
class VideoConfig:
    # frames sampled a second; None: the checkpoint's video_preprocessor_config.json (2)
    fps: float | None = None
    # exactly this many frames instead (excludes fps, as in the reference)
    num_frames: int | None = None
    min_frames: int | None = None  # None: the checkpoint's (4)
    max_frames: int | None = None  # None: the checkpoint's (768)
    min_pixels: int | None = None  # over all frames of one video; None: the checkpoint's
    # cap on the checkpoint's budget over all frames (3072 visual tokens a video)
    max_pixels: int = 3_145_728
    max_decode_pixels: int = 67_108_864  # refuse larger frames before decoding


@dataclass(frozen=True)
class VisionBlocksConfig:
    block_size: int = 5120  # patches per vision block (one batch row of the vision tower)
    num_blocks_buckets: tuple[int, ...] = (1, 2, 4, 8)  # block counts a vision call is padded to
    lookahead: int = 32  # waiting requests considered when forming a wave of images


@dataclass(frozen=True)
class ScanConfig:
    extensions: tuple[str, ...] = (
        ".jpg",
        ".jpeg",
        ".png",
        ".webp",
        ".bmp",
        ".gif",
        ".tif",
        ".tiff",
    )
    video_extensions: tuple[str, ...] = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")

    def is_video(self, name: str | Path) -> bool:
        return str(name).lower().endswith(tuple(e.lower() for e in self.video_extensions))


@dataclass(frozen=True)
class InputsConfig:
    # threads decoding and preprocessing ahead of the engine; 0: one per core but one
    workers: int = 0


@dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 0  # 0: by the run (engine_for)
    max_len: int = 4096
    max_prefill_tokens: int = 16384
    # KV-cache tokens held at most, rows x columns; 0: by the run (engine_for)
    max_cache_tokens: int = 0


# A decode step reads every weight whatever its rows, so where the KV cache grows to the job by
# rows of keys and values alone (the CPU's eager backend) more sequences in flight label faster: on
# a 2-core AMX Xeon 64 images ran at 0.771 images/s with 32, 0.479 with 8 (docs/performance.md).
# The cache those sequences grow is bounded as BOUNDED_SEQS sequences of engine.max_len bounded it.
GROWN_SEQS, BOUNDED_SEQS = 32, 8


def engine_for(engine: EngineConfig, grown: bool, batch_buckets: tuple[int, ...]) -> EngineConfig:
    """The engine settings of a run, its 0s resolved; `grown`: whether the run's cache grows to
    the job (api/loader.resolve_run).

    max_seqs: GROWN_SEQS where it does; else the largest decode batch bucket (compiled and CUDA
    graphs hold the whole cache from the start).
    max_cache_tokens: max_len for each of the max_seqs set; where the run picks them, for each of
    BOUNDED_SEQS (the bucket's where the cache does not grow so). Short prompts then run more at
    once, and long ones take no more memory than before (the scheduler counts each row's fixed
    part too: a hybrid decoder's linear layers' states)."""
    fixed = max(batch_buckets)
    bounded = engine.max_seqs or (BOUNDED_SEQS if grown else fixed)
    return dataclasses.replace(
        engine,
        max_seqs=engine.max_seqs or (GROWN_SEQS if grown else fixed),
        max_cache_tokens=engine.max_cache_tokens or bounded * engine.max_len,
    )


@dataclass(frozen=True)
class CompileConfig:
    # eager, inductor, neuron; auto = eager on the CPU and CUDA (bench/compile_speed.py)
    backend: str = "auto"
    # compiled buckets and their manifest (created user-only)
    cache_dir: str = "~/.cache/mmcli/compile"
    # padded prompt lengths, one prompt per call
    prefill_buckets: tuple[int, ...] = (
        256,
        512,
        1024,
        2048,
        4096,
    )
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)  # sequences per decode step, padded
    # KV columns a decode step reads, padded
    decode_context_buckets: tuple[int, ...] = (
        512,
        1024,
        2048,
        4096,
    )
    # eager backend on CUDA: decode steps replayed from CUDA graphs per bucket
    cuda_graphs: bool = True


def cache_root(setting: str) -> Path:
    """The cache_dir setting as a path: given, or the XDG default."""
    return Path(setting).expanduser() if setting else mmcli_cache()


@dataclass(frozen=True)
class Config:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # computation: activations and accumulation
    weights_dtype: str = "auto"  # weights as held in memory
    quantize: str = "none"  # none, int8 or int4 (CPU)
    # int8 values computed once, read back by later runs: under <cache_dir>/weights
    weights_cache: bool = True
    # on the CPU: auto (huge_pages, but mapped for `mmcli ask`), mapped (the files' pages, loaded
    # at once) or huge_pages (copied at load into 2 MiB pages, which a decode step reads faster)
    weights_memory: str = "auto"
    cache_dir: str = ""  # empty: $XDG_CACHE_HOME/mmcli, else ~/.cache/mmcli
    device: str = "auto"
    prompt: str = "Describe this image."
    # Qwen3.5's thinking mode (the chat template's enable_thinking): reasoning before each answer
    thinking: bool = False
    # the tasks `mmcli caption` runs (--task), each one record per image
    task: tuple[str, ...] = ("caption",)
    tasks: dict[str, TaskConfig] = field(default_factory=lambda: dict(PRESET_TASKS))
    generation: SamplingParams = field(default_factory=SamplingParams)
    image: ImageConfig = field(default_factory=ImageConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    vision: VisionBlocksConfig = field(default_factory=VisionBlocksConfig)
    scan: ScanConfig = field(default_factory=ScanConfig)
    inputs: InputsConfig = field(default_factory=InputsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)

    def __post_init__(self):
        _refuse(self, "", [(key, ok(_get(self, key), self), what) for key, ok, what in _CHECKS])
        _check_tasks(self)
        if self.compile.backend in ("inductor", "neuron"):
            _refuse(self, "", _bucket_checks(self))
        check_vision_budget(self.vision.block_size, self.image.max_pixels)


DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS_MEMORY = ("auto", "mapped", "huge_pages")
COUNTS = "a non-empty list of counts >= 1"
# (key, whether its value is allowed (value, whole config), what it must be)
_CHECKS = [
    ("dtype", lambda v, c: v in DTYPES, ", ".join(DTYPES)),
    ("weights_dtype", lambda v, c: v in DTYPES, ", ".join(DTYPES)),
    ("quantize", lambda v, c: v in ("none", "int8", "int4"), "none, int8, int4"),
    ("thinking", lambda v, c: isinstance(v, bool), "true or false"),
    ("weights_cache", lambda v, c: isinstance(v, bool), "true or false"),
    ("weights_memory", lambda v, c: v in WEIGHTS_MEMORY, ", ".join(WEIGHTS_MEMORY)),
    ("device", lambda v, c: v in ("auto", "cpu", "cuda"), "auto, cpu, cuda"),
    ("inputs.workers", lambda v, c: v >= 0, "0 (one per core but one) or more"),
    ("engine.max_seqs", lambda v, c: v >= 0, "0 (by the run) or more"),
    ("engine.max_len", lambda v, c: v >= 16, "at least 16"),
    ("image.max_decode_pixels", lambda v, c: v > 0, "above 0"),
    ("image.max_pixels", lambda v, c: v > 0, "above 0"),
    ("image.min_pixels", lambda v, c: v is None or v > 0, "above 0"),
    ("video.max_decode_pixels", lambda v, c: v > 0, "above 0"),
    ("video.min_pixels", lambda v, c: v is None or v > 0, "above 0"),
    ("engine.max_prefill_tokens", lambda v, c: v >= 1, "at least 1"),
    (
        "engine.max_cache_tokens",
        lambda v, c: v == 0 or v >= c.engine.max_len,
        "0 (by the run) or at least engine.max_len",
    ),
    ("video.fps", lambda v, c: v is None or v > 0, "above 0"),
    (
        "video.num_frames",
        lambda v, c: v is None or (v >= 1 and c.video.fps is None),
        "at least 1, and not set together with video.fps (the two are exclusive)",
    ),
    ("video.min_frames", lambda v, c: v is None or v >= 1, "at least 1"),
    (
        "video.max_frames",
        lambda v, c: v is None or v >= (c.video.min_frames or 1),
        "at least video.min_frames (and at least 1)",
    ),
    ("video.max_pixels", lambda v, c: v > 0, "above 0"),
    ("vision.num_blocks_buckets", lambda v, c: _counts(v), COUNTS),
    ("vision.lookahead", lambda v, c: v >= 1, "at least 1"),
    (
        "compile.backend",
        lambda v, c: v in ("auto", "eager", "inductor", "neuron"),
        "auto, eager, inductor, neuron",
    ),
    ("compile.prefill_buckets", lambda v, c: _counts(v), COUNTS),
    ("compile.decode_batch_buckets", lambda v, c: _counts(v), COUNTS),
    ("compile.decode_context_buckets", lambda v, c: _counts(v), COUNTS),
]


def _bucket_checks(cfg: Config) -> list:
    """A compiled backend's buckets must hold what the engine may ask for."""
    engine, buckets = cfg.engine, cfg.compile
    return [
        (
            "compile.prefill_buckets",
            max(buckets.prefill_buckets) <= engine.max_len,
            f"token counts none over engine.max_len {engine.max_len}",
        ),
        (
            "compile.decode_batch_buckets",
            max(buckets.decode_batch_buckets) >= engine.max_seqs,
            f"counts whose largest holds engine.max_seqs {engine.max_seqs}",
        ),
        (
            "compile.decode_context_buckets",
            max(buckets.decode_context_buckets) >= engine.max_len,
            f"lengths whose largest holds engine.max_len {engine.max_len}",
        ),
    ]


def _check_tasks(cfg: Config) -> None:
    """Refuse unknown task names, outputs and placeholders, and json tasks without a schema (exit
    2)."""
    if not cfg.task:
        raise ConfigError("config task: the list is empty; name at least one task")
    twice = sorted({name for name in cfg.task if cfg.task.count(name) > 1})
    if twice:
        raise ConfigError(f"config task: {twice[0]!r} is given twice")
    check_prompt(cfg.prompt, "prompt")
    for name in cfg.task:
        if name not in cfg.tasks:
            raise ConfigError(
                f"config task: {name!r} is not a task (known: {', '.join(cfg.tasks)})"
            )
    for name, task in cfg.tasks.items():
        if task.output not in OUTPUTS:
            raise ConfigError(
                f"config tasks.{name}.output: value {task.output!r} must be text, json or boxes"
            )
        if task.output == "json" and not task.schema:
            raise ConfigError(f"config tasks.{name}: output json needs a schema")
        check_prompt(task.prompt, f"tasks.{name}.prompt")
        if task.sidecar is not None:
            check_sidecar(task.sidecar, f"config tasks.{name}.sidecar")
        if task.output == "json" and (task.prefix or task.suffix):
            raise ConfigError(
                f"config tasks.{name}: output json takes no prefix or suffix (its text must stay "
                "the JSON the schema allows)"
            )
        _refuse(
            task,
            f"tasks.{name}.",
            [(k, ok(_get(task, k), task), what) for k, ok, what in _TASK_CHECKS],
        )


def placeholders_in(prompt: str) -> list[str]:
    """The placeholder names a prompt uses (escaped `{{name}}` not counted)."""
    return [m.group(2) for m in PLACEHOLDER.finditer(prompt) if m.group(2)]


def check_prompt(prompt: str, key: str) -> None:
    """Refuse a prompt with an unknown placeholder (exit 2), naming the setting."""
    unknown = [name for name in placeholders_in(prompt) if name not in PLACEHOLDERS]
    if unknown:
        known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
        raise ConfigError(
            f"config {key}: unknown placeholder {{{unknown[0]}}} (known: {known}; "
            "write {{filename}} for the literal text {filename})"
        )


def check_sidecar(ext: str, where: str) -> None:
    """A sidecar extension: a dot, then a name (`.txt`, `.caption.txt`), no folder."""
    if not re.fullmatch(r"\.[A-Za-z0-9_-][A-Za-z0-9_.-]*", ext) or ext.endswith("."):
        raise ConfigError(
            f"{where}: value {ext!r} must be an extension such as .txt (a dot, then a name)"
        )


_TASK_CHECKS = [
    ("max_new_tokens", lambda v, c: v is None or v >= 1, "at least 1"),
    ("temperature", lambda v, c: v is None or v >= 0, "0 or more"),
]


def _refuse(obj, prefix: str, checks: list) -> None:
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"config {prefix}{key}: value {_get(obj, key)!r} must be {expected}")


def _counts(values: tuple[int, ...]) -> bool:
    return len(values) > 0 and all(v >= 1 for v in values)


def check_vision_budget(
    block_size: int,
    max_pixels: int,
    patch_size: int = QWEN_PATCH_SIZE,
    merge_size: int = QWEN_MERGE_SIZE,
) -> None:
    """Every allowed image must fit one block: refuse the config otherwise, saying what would
    fit."""
    unit = merge_size * merge_size
    if block_size < unit or block_size % unit:
        raise ConfigError(
            f"config vision.block_size: {block_size} must be a positive multiple of merge_size^2 "
            f"= {unit}"
        )
    # patches of the largest image smart_resize allows
    largest = max_pixels // (patch_size * patch_size)
    if largest > block_size:
        fits = block_size * patch_size * patch_size
        need = -(-largest // 128) * 128
        raise ConfigError(
            f"config image.max_pixels {max_pixels} allows images of {largest} patches, over "
            f"vision.block_size {block_size}: set image.max_pixels <= {fits} or vision.block_size "
            f">= {need}"
        )


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _coerce(value, hint, key: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"config {key}: expected a mapping, got {value!r}")
        return _build(hint, value, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config {key}: expected a mapping, got {value!r}")
        return {k: _coerce(v, typing.get_args(hint)[1], f"{key}.{k}") for k, v in value.items()}
    if hint is dict and not isinstance(value, dict):
        raise ConfigError(f"config {key}: expected a mapping, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config {key}: {value!r} is not a finite number")
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)) or not all(type(v) is item for v in value):
            raise ConfigError(f"config {key}: expected a list of {item.__name__}, got {value!r}")
        return tuple(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(f"config {key}: expected {hint.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(f"config {prefix}{unknown[0]}: unknown key (known: {', '.join(hints)})")
    return cls(**{k: _coerce(v, hints[k], prefix + k) for k, v in data.items()})


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """Built-in defaults, updated by the YAML file, updated by `overrides` (nested dict, None
    values skipped)."""
    data: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"config {path}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: top level must be a mapping")
        data = loaded or {}

    def prune(d: dict) -> dict:
        return {k: prune(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    presets = {"tasks": {name: dataclasses.asdict(task) for name, task in PRESET_TASKS.items()}}
    return _build(Config, _merge(_merge(presets, data), prune(overrides or {})))


def config_as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_as_yaml(cfg: Config) -> str:
    """The settings as YAML, in the order of configs/default.yaml (tuples as lists)."""

    def plain(value):
        return (
            {k: plain(v) for k, v in value.items()}
            if isinstance(value, dict)
            else list(value)
            if isinstance(value, tuple)
            else value
        )

    return yaml.safe_dump(plain(config_as_dict(cfg)), sort_keys=False).rstrip()
