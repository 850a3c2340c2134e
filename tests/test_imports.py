"""Imports only go down: the package's layers (docs/design.md, docs/architecture.md) in order, and no import cycle between its modules.

Read from the source with `ast`, imports inside functions included (an import deferred to the call is still a
dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import specdraft

ROOT = Path(specdraft.__file__).parent
# Lowest first. A module may import from its own layer and the ones below, never from above.
LAYERS = [
    {"errors", "extras", "paths", "gguf_layout"},
    {"sampling", "tree", "text", "stats", "policy", "goodput", "prompts", "goodness_of_fit"},
    {"kernels"},
    {"models"},
    {"constraints"},
    {"exactness", "verify", "drafters"},
    {"run", "step", "engine", "batch_engine", "prefix_cache"},
    {"analysis"},
    {"bench", "training"},
    {"server"},
    {"surfaces"},
]


def module_name(path: Path) -> str:
    parts = ["specdraft", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports."""
    modules = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specdraft"):
                for alias in node.names:  # `from specdraft.bench import llama_cpp_peer` names a module
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name.startswith("specdraft."))
    return graph


def layer(module: str) -> int | None:
    """The layer of a module below the package's root (None for the root itself, which re-exports the API)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def test_every_module_has_a_layer():
    missing = {module.split(".")[1] for module in import_graph() if "." in module} - set().union(*LAYERS)
    assert not missing, f"add {sorted(missing)} to LAYERS"


def test_imports_only_go_down():
    upward = [(module, target) for module, targets in import_graph().items() for target in targets
              if layer(module) is not None and layer(target) is not None and layer(target) > layer(module)]
    assert not upward, upward


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == "specdraft" or target == module:
                continue
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_package_and_its_cli_leave_transformers_modeling_unimported():
    """Importing specdraft (its API and its command line) does not import transformers' modeling: that took 5-6 s
    and 0.2 GB on a 2-core machine before a command had done anything (`specdraft --help` 10.4 s, then 6.6). A model's
    load imports what it builds. Nor Triton, which only the GPU's fused kernels use (0.3 s and 75 MB where installed)."""
    import subprocess
    import sys

    heavy = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama", "torch._dynamo", "triton")
    script = ("import sys, specdraft, specdraft.surfaces.cli; "
              f"print([name for name in {heavy!r} if name in sys.modules])")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "[]", f"imported with the package: {found}"
