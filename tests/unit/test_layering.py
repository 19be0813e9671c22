"""The package's import graph: layers that read as the data path, with no back-edges.

Every import counts, those inside functions included: a cycle hidden by a function-level import is still a
module that cannot be understood (or loaded) without the one above it."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "slimspec"

HEAVY_MODULES = {"vllm", "triton", "matplotlib", "transformers", "datasets", "huggingface_hub", "gguf", "accelerate",
                 "yaml", "pyarrow", "fcntl", "torch", "safetensors", "glob"}
"""Optional or slow-to-import dependencies: the only ones a function may import (``fcntl``: POSIX only; ``torch``
and the rest inside ``vllm_check``, which runs in vLLM's own environment)."""
HEAVY_SLIMSPEC = {"slimspec.kernels.triton_lowrank", "slimspec.plotting", "slimspec.kernels", "slimspec"}
"""slimspec modules that import a heavy dependency at their top (or, for ``slimspec.kernels`` from its dispatcher
and ``slimspec`` from the plugin and the vLLM check, that must stay light for those processes)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported slimspec module, inside a function?) for every import of the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.append((target, id(node) not in top))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # a module imports its parent packages anyway: those edges are no layering
        graph[name] = {t for t, _ in _imports(path, name, modules) if not name.startswith(t + ".") and t != "slimspec"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    """Catches a back-edge between layers (e.g. distill importing convert's pipeline while convert imports distill),
    function-level imports included."""
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_finds_a_planted_cycle():
    """The check itself: a graph with a back-edge through three modules is reported."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("layer,above", [
    ("slimspec.checkpoint", ("slimspec.convert", "slimspec.distill", "slimspec.evaluate", "slimspec.workflows",
                             "slimspec.cli")),
    ("slimspec.convert", ("slimspec.distill", "slimspec.evaluate", "slimspec.workflows", "slimspec.cli")),
    ("slimspec.distill", ("slimspec.evaluate", "slimspec.workflows", "slimspec.cli")),
    ("slimspec.evaluate", ("slimspec.workflows", "slimspec.cli")),
    ("slimspec.workflows", ("slimspec.cli",)),
])
def test_layers_import_only_downwards(layer, above):
    """Catches a lower layer reaching up (checkpoint < convert < distill < evaluate < workflows < cli)."""
    up = sorted(f"{name} -> {t}" for name, targets in _graph().items() if name.startswith(layer)
                for t in targets if t.startswith(above))
    assert not up, up


def test_functions_import_only_heavy_dependencies():
    """Catches an import hidden in a function to dodge a cycle: inside functions only optional or slow
    dependencies (vLLM, Triton, matplotlib, transformers, ...) and the slimspec modules that wrap them."""
    modules = _modules()
    hidden = []
    for path in modules.values():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in names:
                root = (module or "").split(".")[0]
                if module in HEAVY_SLIMSPEC or (root != "slimspec" and root in HEAVY_MODULES | {"sys"}):
                    continue
                if root != "slimspec" and root not in sys.stdlib_module_names:
                    continue  # a third-party module not listed: reported below only if it is slimspec's own
                hidden.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {module}")
    assert not hidden, hidden
