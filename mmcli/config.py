"""Settings: YAML -> frozen dataclasses. Precedence: CLI > file > these built-in defaults.

configs/default.yaml documents every key with the same values; a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .checkpoint import DEFAULT_MODEL
from .errors import ConfigError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class ImageConfig:
    min_pixels: int | None = None  # None: the checkpoint's preprocessor_config.json
    max_pixels: int | None = None
    max_decode_pixels: int = 134_217_728  # refuse larger files before decoding (decompression bombs)


@dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 8
    max_len: int = 4096
    max_prefill_tokens: int = 16384


@dataclass(frozen=True)
class Config:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    prompt: str = "Describe this image."
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        checks = [
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16, float16"),
            ("device", self.device in ("auto", "cpu", "cuda"), "auto, cpu, cuda"),
            ("generation.max_new_tokens", self.generation.max_new_tokens >= 1, "at least 1"),
            ("generation.temperature", self.generation.temperature >= 0, "0 or more"),
            ("generation.top_p", 0 < self.generation.top_p <= 1, "in (0, 1]"),
            ("generation.top_k", self.generation.top_k >= 0, "0 or more"),
            ("generation.repetition_penalty", self.generation.repetition_penalty > 0, "above 0"),
            ("engine.max_seqs", self.engine.max_seqs >= 1, "at least 1"),
            ("engine.max_len", self.engine.max_len >= 16, "at least 16"),
            ("image.max_decode_pixels", self.image.max_decode_pixels > 0, "above 0"),
        ]
        for key, ok, expected in checks:
            if not ok:
                raise ConfigError(f"config {key}: value {_get(self, key)!r} must be {expected}")


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
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
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
    """Built-in defaults, updated by the YAML file, updated by `overrides` (nested dict, None values skipped)."""
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

    return _build(Config, _merge(data, prune(overrides or {})))


def config_as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
