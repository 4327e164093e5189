"""The import structure of vlbert_core: no import cycle, the model without the data stack, and command lines
that answer --help without importing torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_benchmark_reporting_torch

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "vlbert_core"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module):
    """Every import statement, also those inside functions: an import deferred into a function to dodge
    a cycle is still a cycle between the two modules."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    """module -> the vlbert_core modules it imports (a module's own parent packages excluded: they are
    initialised already when it runs)."""
    paths = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets.add(source)
            targets.update(f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in paths)
        edges = set()
        for target in targets:
            parts = target.split(".")
            # importing a.b.c runs a, a.b and a.b.c
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in paths)
        graph[name] = {t for t in edges if t != name and not name.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_an_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    graph = import_graph()
    assert "vlbert_core.detector.images" in graph["vlbert_core.detector.train"]
    assert "vlbert_core.rois" in graph["vlbert_core.detector.extract"]


def test_vlbert_core_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_model_loads_without_the_data_and_detector_extraction_stack():
    heavy = ["pyarrow", "webdataset", "vlbert_core.rois", "vlbert_core.detector.extract", "vlbert_core.detector.train"]
    code = f"import sys, vlbert_core.model; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["vlbert_core.convert.__main__", "vlbert_core.convert.verify"])
def test_the_converter_command_line_builds_without_torch(module):
    # `python -m vlbert_core.convert --help` (and .verify's) and a mistyped argument answer at once, not after
    # importing torch
    code = (f"import sys; from {module} import build_parser; build_parser(); "
            "print([m for m in ('torch', 'torchvision') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("script", ["default_run", "sentence_readout"])
def test_a_light_benchmark_answers_help_without_torch(script):
    # their --help (and default_run.py's --rules-only) need no model: they answer at once
    result = run_benchmark_reporting_torch(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and result.stdout.rstrip().endswith("imported: []")
