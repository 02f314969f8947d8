"""A family owns its module tree: the shared rooms reach a model only through the Family protocol
and the tree's top (models/family.py), so none of them spells a name from below it, as an
attribute or in a checkpoint path, and none imports a family's package. The names are read from
every family's own module tree, built on the meta device."""

import ast
import re
from pathlib import Path

import pytest
import torch

from mmcli import testing
from mmcli.models.registry import FAMILIES, family_of, parse_config

PACKAGE = Path(__file__).resolve().parent.parent / "mmcli"
SHARED_ROOMS = ("weights", "kernels", "engine", "api")
# the tree's top, which the protocol names; "rotary" is also a kind of work (the kernel plan's
# entry, the C library's function), not only the attribute that holds the layer doing it
PROTOCOL = {"model", "visual", "language_model", "lm_head", "weight", "bias", "rotary"}


def tiny_configs() -> list[dict]:
    return [
        testing.tiny_config(),
        testing.tiny_qwen3_5_config("qwen3_5", 384, {}),
        *(testing.tiny_moe_config(variant, 384, {}) for variant in testing.MOE_VARIANTS),
    ]


def tree_names() -> set[str]:
    """Every module and parameter name below the protocol's, in every family's tree."""
    names = set()
    for raw in tiny_configs():
        cfg = parse_config(raw)
        with torch.device("meta"):
            model = family_of(cfg).build(cfg)
        for path, _ in [*model.named_modules(), *model.named_parameters()]:
            names |= {part for part in path.split(".") if part and not part.isdigit()}
    return names - PROTOCOL


def test_the_tiny_configs_cover_every_family():
    assert {raw["model_type"] for raw in tiny_configs()} == set(FAMILIES)


def shared_sources() -> list[Path]:
    return [p for room in SHARED_ROOMS for p in sorted((PACKAGE / room).rglob("*.py"))]


def code_strings_and_attributes(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(attribute names accessed, string constants) with their lines; docstrings and imports
    left out (prose and module paths are not the tree)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    attributes = [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    strings = [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]
    return attributes, strings


def test_the_shared_rooms_name_nothing_of_a_familys_tree():
    names = tree_names()
    assert {"self_attn", "q_proj", "blocks", "linear_attn", "embed_tokens"} <= names
    dotted = re.compile(rf"(?:^|\.)({'|'.join(sorted(names))})(?:\.|$)")
    found = []
    for path in shared_sources():
        attributes, strings = code_strings_and_attributes(path)
        where = path.relative_to(PACKAGE)
        found += [f"{where}:{line}: .{attr}" for line, attr in attributes if attr in names]
        found += [
            f"{where}:{line}: {text!r}"
            for line, text in strings
            if "." in text and " " not in text and dotted.search(text)
        ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("room", SHARED_ROOMS)
def test_the_shared_rooms_import_no_family(room):
    families = tuple(module for module, _ in FAMILIES.values())
    found = []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            found += [f"{path.name}: {m}" for m in modules if m.startswith(families)]
    assert not found
