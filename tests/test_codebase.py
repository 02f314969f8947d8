"""The shape of the code: short functions and modules, and a light `import mmcli`."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mmcli"
MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_are_short(module):
    source = module.read_text()
    assert len(source.splitlines()) <= 300, (
        f"{module.name}: {len(source.splitlines())} lines, over 300"
    )
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= 60
    ]
    assert not long, f"{module.name}: functions over 60 lines: {', '.join(long)}"


@pytest.mark.parametrize(
    "statement",
    [
        "import mmcli",
        "import mmcli.cli.app",
        "from mmcli.jobs import caption, resume; from mmcli.cli import plan",
    ],
)
def test_import_does_not_load_torch(statement):
    loaded = "sorted(m for m in ('torch', 'transformers') if m in sys.modules)"
    check = f"{statement}; import sys; print({loaded})"
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_public_names_load_on_first_use():
    import mmcli

    assert mmcli.Labeler.__name__ == "Labeler" and mmcli.load_config().engine.max_seqs >= 1
    with pytest.raises(AttributeError):
        mmcli.nothing_here  # noqa: B018


def test_readme_maps_every_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme.split("## The code, module by module")[1].split("\n## ")[0]
    listed = {
        cell.strip("`")
        for line in table.splitlines()
        if line.startswith("| `")
        for cell in [line.split("|")[1].strip()]
    }
    top = {p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    model = {p.name for p in (PACKAGE / "model").glob("*.py") if p.name != "__init__.py"}
    assert listed == top | {"model/"}, sorted(listed ^ (top | {"model/"}))
    assert all(f"`{name}`" in table for name in model)
