"""The import structure of vlbert_core: no import cycle, each model family reached through the registry only, the
model without the data stack, and command lines that answer --help without importing torch."""

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


FAMILY_PACKAGES = ("vlbert_core.models.vlbert", "vlbert_core.models.vilbert")


def family_of(module: str) -> str | None:
    """The family package `module` is (or is in), or None."""
    return next((f for f in FAMILY_PACKAGES if module == f or module.startswith(f + ".")), None)


def family_boundary_crossings(graph: dict[str, set[str]]) -> list[str]:
    """"importer -> family module" for every import of a family package from outside it, but by the registry and
    by the family's own converter (vlbert_core.convert.<family>)."""
    crossings = []
    for importer, targets in graph.items():
        for target in sorted(targets):
            family = family_of(target)
            if family is None or family_of(importer) == family or importer == "vlbert_core.models.registry":
                continue
            converter = "vlbert_core.convert." + family.rsplit(".", 1)[1]
            if importer == converter or importer.startswith(converter + "."):
                continue
            crossings.append(f"{importer} -> {target}")
    return crossings


def test_the_boundary_check_sees_a_family_imported_from_outside():
    graph = {"vlbert_core.tasks.x": {"vlbert_core.models.vilbert.heads"},
             "vlbert_core.models.vlbert.model": {"vlbert_core.models.common.batch"},
             "vlbert_core.models.registry": {"vlbert_core.models.vlbert.model"},
             "vlbert_core.convert.vilbert.checkpoint": {"vlbert_core.models.vilbert.model",
                                                        "vlbert_core.models.vlbert.heads"}}
    assert family_boundary_crossings(graph) == [
        "vlbert_core.tasks.x -> vlbert_core.models.vilbert.heads",
        "vlbert_core.convert.vilbert.checkpoint -> vlbert_core.models.vlbert.heads"]


def test_only_the_registry_imports_a_model_family():
    # tasks, prediction, pre-training, the tables and the shared converters reach a family through its registry
    # record (vlbert_core/models/registry.py), lazy imports inside functions included
    assert family_boundary_crossings(import_graph()) == []


def test_a_family_defined_outside_the_library_registers_itself(monkeypatch):
    from vlbert_core.models import registry

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))

    class ToyConfig:
        @classmethod
        def from_dict(cls, fields):
            return dict(fields)

    class ToyModel:
        model_type = "toy"
        config_class = ToyConfig

        def __init__(self, config):
            self.config = config

    record = registry.register_family(registry.Family(
        model_type="toy", display_name="Toy", model_class=ToyModel, config_builder=None, pretraining_module=None,
        alignment_readout=None))
    assert registry.family("toy") is record and "toy" in registry.model_types()
    assert record.config_class is ToyConfig and registry.model_class("toy") is ToyModel
    assert registry.build_model("toy", {"width": 2}).config == {"width": 2}
    assert registry.split_model_type({"model_type": "toy", "width": 2}, "here") == ("toy", {"width": 2})


def test_the_registry_names_every_part_of_the_built_in_families():
    from vlbert_core.models import registry

    for record in registry.families():
        model = record.load("model_class")
        assert model.model_type == record.model_type and record.config_class.model_type == record.model_type
        for part in ("config_builder", "pretraining_module", "alignment_readout", "converter"):
            assert record.load(part) is not None, (record.model_type, part)
    assert [r.display_name for r in registry.families()] == ["VL-BERT", "ViLBERT"]


@pytest.mark.slow
def test_the_model_loads_without_the_data_and_detector_extraction_stack():
    heavy = ["pyarrow", "webdataset", "vlbert_core.rois", "vlbert_core.detector.extract", "vlbert_core.detector.train"]
    code = ("import sys, vlbert_core.models.vlbert.model, vlbert_core.models.vilbert.model; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
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


@pytest.mark.parametrize("script", ["default_run", "diagnostics/sentence_readout"])
def test_a_light_benchmark_answers_help_without_torch(script):
    # their --help (and default_run.py's --rules-only) need no model: they answer at once
    result = run_benchmark_reporting_torch(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and result.stdout.rstrip().endswith("imported: []")
