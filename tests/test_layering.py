"""The layers' arrows point down, and stay so:

    ir -> passes -> codegen -> backends -> cortex.{cus,dag,dag_checks} -> cortex.runtime -> cortex.tools
       -> cortex (CLI)

A module imports only from its own layer or the layers below it, at the top of the file: no
import cycles, and no function-local import of a project module that could hide one. bench/,
samples/ and tests/ sit on top and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    ("ir", ("ir",)),
    ("passes", ("passes",)),
    ("codegen", ("codegen",)),
    ("backends", ("backends",)),
    ("bundle", ("cortex.cus", "cortex.dag", "cortex.dag_checks", "cortex.specializations",
                "cortex.value_specializations")),
    ("runtime", ("cortex.runtime",)),
    ("tools", ("cortex.tools",)),
    ("cli", ("cortex",)),
]
PROJECT = {"ir", "passes", "codegen", "backends", "cortex", "bench", "samples"}
# Imports that must run late, each for a reason that is not a cycle.
LATE_IMPORTS_ALLOWED = {
    ("cortex.entry", "cortex.cli"): "the SIGINT handler must be installed before the CLI's imports",
    ("passes.contrib_shapes", "passes.contrib_symbolic"): "onnxruntime.tools imports torch where it is installed "
                                                          "(3 s of every command's start): only models with "
                                                          "contrib nodes pay it",
}


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return best[0] if best else None


def modules() -> dict[str, Path]:
    found = {}
    for package in ("ir", "passes", "codegen", "backends", "cortex"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """(module imported, at the top level?, line) for each import of a project module."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from package import module` imports the module, not only the package.
            targets = [f"{base}.{alias.name}" if (ROOT / Path(*base.split("."), alias.name)).with_suffix(".py").is_file()
                       or (ROOT / Path(*base.split("."), alias.name, "__init__.py")).is_file() else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PROJECT:
                found.append((target, id(node) in top_level, node.lineno))
    return found


def test_imports_point_down():
    wrong = []
    for name, path in modules().items():
        own = layer_of(name)
        for target, _, line in imports_of(name, path):
            theirs = layer_of(target)
            if theirs is None or theirs > own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports {target} "
                             f"({'outside the layers' if theirs is None else LAYERS[theirs][0]})")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_runtime_never_imports_tools():
    """The request path (cortex.runtime) stands without the tools that calibrate, compare, bisect,
    reproduce and find crossovers: anything the runtime reads of theirs, it reads with its own code.
    Any import counts here, a late one included."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for name, path in modules().items() if layer_of(name) == layer_named("runtime")
             for target, _, line in imports_of(name, path) if layer_of(target) == layer_named("tools")]
    assert not wrong, "the runtime imports a tool:\n" + "\n".join(wrong)


def layer_named(name: str) -> int:
    return [layer for layer, _ in LAYERS].index(name)


def test_no_function_local_imports_of_project_modules():
    late = []
    for name, path in modules().items():
        for target, top, line in imports_of(name, path):
            if not top and (name, target) not in LATE_IMPORTS_ALLOWED:
                late.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function or block")
    assert not late, "late imports (move them to the top; a cycle they hide must be cut):\n" + "\n".join(late)


def test_no_import_cycles():
    graph = nx.DiGraph()
    known = modules()
    for name, path in known.items():
        for target, _, _ in imports_of(name, path):
            graph.add_edge(name, target if target in known else target.rpartition(".")[0])
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1 and not _package_and_its_module(c)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def _package_and_its_module(cycle: list[str]) -> bool:
    """A package's __init__ importing its own submodule, which imports a sibling through the
    package name, is Python's normal shape, not a cycle between layers."""
    return len(cycle) == 2 and (cycle[0].startswith(cycle[1] + ".") or cycle[1].startswith(cycle[0] + "."))


@pytest.mark.parametrize("package", ["ir", "passes", "codegen", "backends", "cortex"])
def test_no_file_is_over_500_lines(package):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 520]
    assert not long, "\n".join(long)


MAX_PARAMETERS = 8


@pytest.mark.parametrize("package", ["codegen", "backends"])
def test_no_codegen_function_has_more_than_8_parameters(package):
    """A renderer that needs more takes a spec or a small dataclass of offsets or options instead
    (`GemmSpec` with `GemmOffsets` and `GemmLayout`, `ConvOffsets`). Every parameter counts but
    `self` and `cls`, `*args` and `**kwargs` included."""
    wide = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
                count = len([name for name in names if name not in ("self", "cls")])
                if count > MAX_PARAMETERS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', 'lambda')}: "
                                f"{count} parameters")
    assert not wide, "\n".join(wide)
