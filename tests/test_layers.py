"""The layers of mmcli: each package imports only itself and the layers below it, and no module
imports itself back through others (read from the source with ast, function-level imports
included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mmcli"
# Top to bottom; a module may import its own layer and the layers below it.
LAYERS = [
    ["mmcli", "mmcli.__main__", "mmcli.testing"],
    ["mmcli.cli"],
    ["mmcli.jobs", "mmcli.review", "mmcli.serve"],
    ["mmcli.api"],
    ["mmcli.inputs"],
    ["mmcli.engine"],
    ["mmcli.compiled"],
    ["mmcli.config", "mmcli.tasks"],
    ["mmcli.weights"],
    # the families above the blocks they compose; the registry finds the families
    ["mmcli.models.registry"],
    [
        "mmcli.models.qwen3_vl",
        "mmcli.models.qwen3_vl_moe",
        "mmcli.models.qwen3_5",
        "mmcli.models.qwen3_5_moe",
    ],
    ["mmcli.models.layers", "mmcli.models.cache"],
    ["mmcli.models.config", "mmcli.models.family"],
    ["mmcli.kernels"],
    ["mmcli.errors", "mmcli.paths", "mmcli.hosts"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    best = None
    for rank, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > len(best[1])
            ):
                best = (rank, name)
    assert best is not None, f"{module} is in no layer"
    return best[0]


def imports(module: str) -> set[str]:
    """The package modules `module` imports (a name imported from a package counts as its
    module)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{module}: relative import; mmcli imports by absolute name")
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and name != "mmcli":
                found.add(name)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_import_runs_down_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if layer_of(t) < layer_of(m)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_layer_test_sees_a_violation():
    # The checks above would pass on an empty graph; make sure they read real imports.
    assert "mmcli.engine.runner" in GRAPH["mmcli.engine.loop"]
    assert layer_of("mmcli.engine.loop") > layer_of("mmcli.cli.app")
