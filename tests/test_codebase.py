"""The shape of the code: short functions and modules, and a light `import mmcli`."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmcli.testing import installed_command

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mmcli"
MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_are_short_and_no_conditional_expression_is_a_statement(module):
    tree = ast.parse(module.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= 60
    ]
    assert not long, f"{module.name}: functions over 60 lines: {', '.join(long)}"
    used_as_statement = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.IfExp, ast.BoolOp))
    ]
    assert not used_as_statement, f"{module.name}: a conditional expression as a statement"


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_lint_and_format_are_clean(args):
    run = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "mmcli", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_c_kernels_are_formatted_by_clang_format():
    """The C beside the Python has one formatter too (.clang-format: 100 columns; the test
    extra pins clang-format's major version, whose output can change between them)."""
    sources = sorted((PACKAGE / "kernels" / "csrc").glob("*.[ch]"))
    assert len(sources) >= 8
    run = subprocess.run(
        [installed_command("clang-format"), "--dry-run", "--Werror", *map(str, sources)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]


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


@pytest.mark.parametrize(
    "args", [["--help"], ["config", "show"], ["plan", "--tokens", "512,256,128"]]
)
def test_the_commands_that_load_no_model_import_no_torch(args):
    """What keeps them fast (bench/cpu.py times them): they run without torch."""
    run = (
        "import sys\nfrom mmcli.cli.app import app\n"
        f"sys.argv = ['mmcli', *{args!r}]\n"
        "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True)
    assert done.stderr.split()[-2:] == ["0", "False"], done.stderr[-2000:]


def test_public_names_load_on_first_use():
    import mmcli

    assert mmcli.Labeler.__name__ == "Labeler" and mmcli.load_config().engine.max_len >= 1
    with pytest.raises(AttributeError):
        mmcli.nothing_here  # noqa: B018


def test_the_module_map_lists_every_module():
    table = (ROOT / "docs" / "internals.md").read_text().split("## The code, module by module")[1]
    listed = {
        line.split("|")[1].strip().strip("`")
        for line in table.splitlines()
        if line.startswith("| `")
    }
    modules = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert listed == modules, sorted(listed ^ modules)


def test_readme_is_a_guide_and_its_links_work():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 3
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
        for anchor in re.findall(r"\]\(#([^)]+)\)", text):
            slugs = {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", text)}
            if anchor not in slugs:
                broken.append(f"{page.relative_to(ROOT)}: #{anchor}")
    assert not broken, broken


def test_the_docs_are_for_readers():
    """What a feature does and its figures, not lab notes: no section named by an issue, no
    "this session" or "the next session" (history goes to CHANGELOG.md and commit messages)."""
    notes = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(r"(?i)\bsession\b", line) or re.match(r"#+ .*\bissue \d+", line):
                notes.append(f"{page.relative_to(ROOT)}:{n}: {line[:80]}")
    assert not notes, notes


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
