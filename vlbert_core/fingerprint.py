"""Fingerprints of the library code each workflow job runs, passed to Snakemake through `params:`.

Snakemake re-runs a job when its rule's `script:` changes, but it does not see the `vlbert_core`
modules that script imports. `code_fingerprint(root, script, task)` hashes the script and every
`vlbert_core` module it imports, directly or through other modules (found by reading their
import statements, including imports inside functions, the modules they name in a string to import
on use, as the model registry does, the submodule a lazy package's `_SUBMODULE_OF` table loads an imported
name from, as vlbert_core.detector does, and the `__init__.py` of every package on the way). A job whose fingerprint changes is re-run, and Snakemake re-runs its downstream jobs
because their inputs change.

Task-specific code is kept apart: the modules a registered task lists as its own
(`Task.owned_modules`) belong to its family, and a job of another family leaves them out of its
fingerprint. Editing the VQA head or samples (`tasks/modeling/vqa.py`)
therefore re-runs the VQA fine-tunes and evaluations, not the VCR or RefCOCO+ ones.

Blank lines, whole-line comments and trailing spaces are left out of the hash, so such edits
re-run nothing; any other edit does, including a comment at the end of a line of code and a
docstring.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

PACKAGE = "vlbert_core"

def task_modules() -> dict[str, tuple[str, ...]]:
    """{task family (a task's dataset): the modules only its tasks use, relative to the package},
    from the task registry. Every other module a script imports is shared, and an edit of it
    re-runs every task."""
    from vlbert_core.tasks.registry import TASK_TEMPLATES, registered_tasks

    modules: dict[str, tuple[str, ...]] = {}
    for task in (*TASK_TEMPLATES, *registered_tasks()):
        modules[task.dataset] = tuple(dict.fromkeys((*modules.get(task.dataset, ()), *task.owned_modules)))
    return modules


def task_family(task: str) -> str:
    """The family of a fine-tune or eval task name: the dataset of the registered task it belongs to
    (vcr_q2a, vcr_qa2r, vcr_q2ar -> vcr); a task dataset's name is its own family (flickr30k, whose task is
    retrieval: the RoI extraction of a dataset)."""
    from vlbert_core.tasks.registry import task_datasets, task_names, task_of_name

    if task not in task_names() and task in task_datasets():
        return task
    return task_of_name(task).dataset


def _module_file(root: Path, module: str) -> Path | None:
    """The file of a dotted vlbert_core module name, or None if it names no module."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(root: Path, path: Path) -> str:
    """Dotted name of the package a module file lives in (the package itself for __init__.py)."""
    relative = path.relative_to(root).with_suffix("")
    parts = list(relative.parts)
    parts.pop()  # the module's own name, or "__init__"
    return ".".join(parts)


_FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.MULTILINE)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n]*)", re.MULTILINE)
# a module named in a string, imported when used: the model registry's "vlbert_core.models.vlbert.model:VLBertModel"
_NAMED_MODULE = re.compile(r"[\"'](vlbert_core(?:\.\w+)+)(?::\w+)?[\"']")
# A family's converter, which the registry names too, is code of the jobs that run the converter command only:
# followed from the registry, it would make every model job depend on the converters and the task code they use.
CONVERTER_COMMAND = "vlbert_core.convert.__main__"
CONVERTERS = "vlbert_core.convert."


# A lazy package (its __init__ loads each name from a submodule on first use): `_SUBMODULE_OF = {"name": "sub"}`
_LAZY_TABLE = re.compile(r"^_SUBMODULE_OF[^=]*=\s*\{(.*?)\}", re.MULTILINE | re.DOTALL)
_LAZY_ENTRY = re.compile(r"[\"'](\w+)[\"']\s*:\s*[\"'](\w+)[\"']")


def _lazy_submodules(root: Path, package: str) -> dict[str, str]:
    """{name: dotted submodule} of a lazy package's `_SUBMODULE_OF` table; {} for any other module."""
    init = root.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return {}
    table = _LAZY_TABLE.search(_source(init, init.stat().st_mtime_ns))
    return {name: f"{package}.{sub}" for name, sub in _LAZY_ENTRY.findall(table.group(1))} if table else {}


def _names(clause: str) -> list[str]:
    """`a, b as c` / `(a,\n b)` -> ["a", "b"]."""
    clause = re.sub(r"#[^\n]*", "", clause).strip("()\\ \t\n")
    return [part.split(" as ")[0].strip() for part in clause.split(",") if part.strip()]


def _imported_modules(root: Path, path: Path) -> frozenset[str]:
    """Dotted vlbert_core modules that `path` imports (candidates; _module_file checks them).

    Import statements are found by a regular expression over the source, not by parsing it:
    this runs each time Snakemake reads the workflow, and parsing every module takes a second
    on a small machine. An import written in a string or docstring counts too, which can only
    add a module to a fingerprint, never miss one.
    """
    source = _source(path, path.stat().st_mtime_ns)
    names: set[str] = set()
    in_package = path.is_relative_to(root / PACKAGE)
    for match in _FROM_IMPORT.finditer(source):
        module, clause = match.group(1), match.group(2)
        level = len(module) - len(module.lstrip("."))
        if level:
            if not in_package:
                continue
            package = _package_of(root, path).split(".")
            base_parts = package[: len(package) - (level - 1)]
            module = ".".join(base_parts + ([module[level:]] if module[level:] else []))
        names.add(module)
        names.update(f"{module}.{name}" for name in _names(clause))  # `from pkg import submodule`
        lazy = _lazy_submodules(root, module) if module.split(".")[0] == PACKAGE else {}
        names.update(lazy[name] for name in _names(clause) if name in lazy)  # `from lazy_pkg import a_name`
    for match in _IMPORT.finditer(source):
        names.update(_names(match.group(1)))
    names.update(name for name in _named_modules(source) if not name.startswith(CONVERTERS))
    modules = set()
    for name in names:
        parts = name.split(".")
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(m for m in modules if m.split(".")[0] == PACKAGE)


def _named_modules(source: str) -> set[str]:
    """The vlbert_core modules a source names in strings ("pkg.module" or "pkg.module:attr")."""
    return {match.group(1) for match in _NAMED_MODULE.finditer(source)}


def code_files(root: str | Path, script: str | Path) -> list[Path]:
    """The script and every vlbert_core file it imports, transitively, sorted."""
    root = Path(root).resolve()
    start = (root / script).resolve()
    seen: set[Path] = set()
    command = _module_file(root, CONVERTER_COMMAND)
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _imported_modules(root, path):
            file = _module_file(root, module)
            if file is not None and file.resolve() not in seen:
                todo.append(file.resolve())
        if not todo and command is not None and command.resolve() in seen:
            # the converter command's job: the converters the files it runs name (the registry's) run too
            named = {".".join(name.split(".")[:i]) for file in seen
                     for name in _named_modules(_source(file, file.stat().st_mtime_ns))
                     for i in range(2, name.count(".") + 2)}
            todo = [file.resolve() for file in map(lambda m: _module_file(root, m), sorted(named))
                    if file is not None and file.resolve() not in seen]
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def _source(path: Path, mtime_ns: int) -> str:
    return path.read_text(encoding="utf-8")


def _code_digest(path: Path) -> str:
    """Hash of the file without blank lines, whole-line comments and trailing spaces."""
    source = _source(path, path.stat().st_mtime_ns)
    lines = (line.rstrip() for line in source.splitlines())
    code = "\n".join(line for line in lines if line and not line.lstrip().startswith("#"))
    return hashlib.sha256(code.encode("utf-8")).hexdigest()


def code_fingerprint(root: str | Path, script: str | Path, task: str | None = None) -> str:
    """A short hash of the code a job of `script` (for `task`, if task-specific) runs."""
    root = Path(root).resolve()
    excluded: set[Path] = set()
    if task is not None:
        family = task_family(task)
        owned = task_modules()
        excluded = {
            (root / PACKAGE / module).resolve()
            for other, modules in owned.items()
            if other != family
            for module in modules
            if module not in owned.get(family, ())  # a config entry's task shares its template's modules
        }
    digest = hashlib.sha256()
    for path in code_files(root, script):
        if path in excluded:
            continue
        digest.update(str(path.relative_to(root)).encode("utf-8") + b"\0")
        digest.update(_code_digest(path).encode("ascii"))
    return digest.hexdigest()[:16]
