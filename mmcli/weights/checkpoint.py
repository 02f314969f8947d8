"""Checkpoints in the released Hugging Face layout: config.json and safetensors weights, read and
checked by name and shape against the family's module tree."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from mmcli.errors import CheckpointError
from mmcli.models.config import ModelConfig
from mmcli.models.layers.moe import EXPERTS, PROJECTIONS, held_name
from mmcli.models.registry import family_of
from mmcli.weights import int4 as int4_weights
from mmcli.weights.hub import read_config


def read_model_config(path: Path) -> ModelConfig:
    return read_config(path)[1]


@dataclass(frozen=True)
class Layout:
    """The model's module tree as names, built once per config on the meta device (no memory),
    so it cannot drift from the modules: every tensor's shape, the matrices (every linear layer's
    weight, the embeddings, the patch embedding: what `weights_dtype` applies to; norms and
    biases are held in the compute dtype) and what int4 may take (the decoder's linears but its
    family's kept ones, the lm_head, the experts as held)."""

    shapes: dict[str, tuple[int, ...]]
    matrices: frozenset[str]
    int4: frozenset[str]


@functools.lru_cache(maxsize=4)
def layout(cfg: ModelConfig) -> Layout:
    from torch import nn

    from mmcli.models.layers.linear import Linear

    with torch.device("meta"):
        model = family_of(cfg).build(cfg)
    kept = family_of(cfg).kept_linears(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tables = (Linear, nn.Embedding, nn.Conv3d)
    matrices = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, tables)}
    experts = {n for n, _ in model.named_parameters() if n.endswith(EXPERTS)}
    decoder = {id(m) for m in model.language_model.modules()} | {id(model.lm_head)}
    int4 = {
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, Linear) and id(m) in decoder and m not in kept
    }
    return Layout(shapes, frozenset(matrices | experts), frozenset(int4 | experts))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the released layout and its shape."""
    return dict(layout(cfg).shapes)


def matrix_weight_names(cfg: ModelConfig) -> set[str]:
    return set(layout(cfg).matrices)


def int4_shapes(cfg: ModelConfig) -> int4_weights.Int4Shapes:
    """What `quantize: int4` makes of this model: its 4-bit matrices and experts."""
    names = layout(cfg)
    return int4_weights.Int4Shapes.of(names.shapes, names.int4, cfg.tie_word_embeddings)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(
            f"{path}: weight files missing: {', '.join(missing) or 'no *.safetensors'}"
        )
    return files


@dataclass
class Weights:
    """A checkpoint as read: tensors by name, and with `quantize: int4` the 4-bit matrices (by
    name) and MoE experts (by their prefix) quantized as they were read."""

    tensors: dict[str, torch.Tensor]
    int4: dict = field(default_factory=dict)
    experts_int4: dict = field(default_factory=dict)


def load_weights(
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    weights_dtype: torch.dtype | None = None,
    int4: bool = False,
    int4_prepared: tuple[dict, dict] | None = None,
) -> Weights:
    """All tensors, checked by name and shape against the config (safetensors only): the matrices
    in `weights_dtype` (default `dtype`), the rest in `dtype`; with `int4`, the matrices int4
    takes quantized as read, or where `int4_prepared` gives them (matrices, experts: the
    prepared file's), not read at all. A tensor already in its dtype is not copied again."""
    expected, names, family = expected_shapes(cfg), layout(cfg), family_of(cfg)
    unused = family.unused_tensor
    if int4_prepared is not None:
        covered = int4_shapes(cfg)
        unused = lambda name: family.unused_tensor(name) or covered.covers(name)  # noqa: E731
    matrices = names.matrices if weights_dtype not in (None, dtype) or int4 else frozenset()
    weights = Weights({})
    slab = int4_weights.Slab()

    def keep(name: str, tensor: torch.Tensor) -> None:
        if int4 and int4_weights.eligible(
            name, tuple(tensor.shape), names.int4, cfg.tie_word_embeddings
        ):
            weights.int4[name] = int4_weights.quantize_read(name, tensor, expected.get(name), slab)
        else:
            held = tensor.to(weights_dtype or dtype if name in matrices else dtype)
            # safetensors maps the file: a tensor held as stored shares its pages. With int4 most
            # of each file is read once and dropped, so own a copy and let the mapping go (else
            # every page read stays resident while one small tensor of its file lives).
            weights.tensors[name] = held.clone() if int4 and held is tensor else held

    for file in _weight_files(path):
        _read_file(file, keep, unused)
    try:
        if int4:
            matrices, experts = int4_prepared or ({}, {})
            weights.int4.update(matrices)
            quantized = int4_weights.experts_int4(weights.int4, expected)
            weights.experts_int4 = {**quantized, **experts}
        family_of(cfg).map_checkpoint(weights.tensors, expected)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    tensors = weights.tensors
    if "lm_head.weight" not in tensors and cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors.get(family.token_embedding)
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if t is not None}
    shapes.update({n: tuple(w.shape) for n, w in weights.int4.items()})
    for prefix in weights.experts_int4:
        for projection in PROJECTIONS:
            shapes[held_name(prefix, projection)] = expected[held_name(prefix, projection)]
    _check(path, expected, shapes)
    return weights


def _read_file(file: Path, keep, unused) -> None:
    """Every tensor of one safetensors file to `keep(name, tensor)`, but those `unused(name)`
    (left unread)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if not unused(n)]
        while names:
            # Reopen every ~512 MB: closing unmaps the file, so its pages stop counting as
            # resident memory while the copies are made (the peak stays near the weights as
            # held, not those plus the file).
            with safe_open(str(file), framework="pt") as f:
                read = 0
                while names and read < 512 << 20:
                    name = names.pop(0)
                    t = f.get_tensor(name)
                    read += t.numel() * t.element_size()
                    keep(name, t)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors ({str(e)[:160]})") from None


def _check(path: Path, expected: dict[str, tuple], shapes: dict[str, tuple]) -> None:
    missing = sorted(n for n in expected if n not in shapes)
    unexpected = sorted(n for n in shapes if n not in expected)
    wrong = [
        f"{n} {shapes[n]} != {expected[n]}"
        for n in expected
        if n in shapes and shapes[n] != expected[n]
    ]
    problems = []
    for label, names in (
        ("missing tensors", missing),
        ("unexpected tensors", unexpected),
        ("wrong shapes", wrong),
    ):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            problems.append(f"{label}: {', '.join(names[:3])}{more}")
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}")
