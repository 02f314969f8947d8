"""The families mmcli runs, keyed by config.json's model_type: a new family is a package and one
line here. Packages are imported when their model_type is asked for."""

from __future__ import annotations

import importlib

from mmcli.errors import UnsupportedModel
from mmcli.models.config import ModelConfig
from mmcli.models.family import Family

FAMILIES = {
    "qwen3_vl": ("mmcli.models.qwen3_vl", "Qwen3-VL"),
    "qwen3_5": ("mmcli.models.qwen3_5", "Qwen3.5"),
    "qwen3_vl_moe": ("mmcli.models.qwen3_vl_moe", "Qwen3-VL MoE"),
    "qwen3_5_moe": ("mmcli.models.qwen3_5_moe", "Qwen3.5 MoE"),
}


def family(model_type: str) -> Family:
    return importlib.import_module(FAMILIES[model_type][0]).FAMILY


def family_of(cfg: ModelConfig) -> Family:
    return family(cfg.family)


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """A checkpoint's config.json, read by the family its model_type names."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        archs = ",".join(raw.get("architectures") or []) or "?"
        runs = ", ".join(f"{k} ({name})" for k, (_, name) in FAMILIES.items())
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} ({archs}) is not a family mmcli runs: {runs}"
        )
    return family(model_type).read_config(raw, where)
