"""The own-data example's documented numbers (README "Your own data", docs/own-data.md) cannot go stale
silently (issue #40).

docs/own-data.md states the numbers that `config/own_data_example.yaml` gives, with a stamp: the date and
commit they were measured at, and a fingerprint of everything that decides them: the example config, the
default config (less the fine-tuning recipes of tasks the example does not run) and schema it is layered on,
and the code fingerprint (vlbert_core.fingerprint, what the
workflow re-runs a job on) of every job of the example's DAG. These tests fail when

- the stamp is missing, or names a commit this repository does not have;
- any of those changed after the measurement (the fingerprint differs): run the example again and update the
  numbers and the stamp;
- the example's DAG has a job whose code the fingerprint does not cover;
- the README's numbers, or the date and commit it names, differ from docs/own-data.md's;
- a documented p-value does not follow from the documented counts of discordant rows.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_workflow import planned_rules, snakemake

from vlbert_core.fingerprint import code_fingerprint
from vlbert_core.stats import format_p_value, mcnemar_exact
from vlbert_core.tasks import registry
from vlbert_core.utils import read_yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "own-data.md"
README = REPO / "README.md"
EXAMPLE_CONFIG = "config/own_data_example.yaml"
EXAMPLE_TARGET = "results/tables/custom_example.csv"
# The files that decide the example's numbers besides the code: its config, the default config and schema it
# is layered on, and the world's example generator.
DEFAULT_CONFIG = "config/config.yaml"
EXAMPLE_INPUTS = (EXAMPLE_CONFIG, DEFAULT_CONFIG, "config/schema.yaml", "vlbert_core/world/custom_example.py")
# The example fine-tunes only its own task, so the default config's recipes of the other tasks (`finetune.vqa`,
# ...) cannot move its numbers; the default config is hashed as parsed, without them (and without comments).
EXAMPLE_FINETUNE_TASKS = ("custom_example",)
# Every job of the example's DAG: rule -> (its workflow script, the task its code fingerprint is taken for), as
# the rule's `params: code=` is (workflow/rules/*.smk).
EXAMPLE_JOBS = {
    "world": ("world", None), "custom_example": ("custom_example", None), "custom_rows": ("custom_rows", None),
    "partition_cc": ("partition_cc", None), "download_cc": ("download_cc", None), "shard_text": ("shard_text", None),
    "train_detector": ("train_detector", None), "extract_rois": ("extract_rois", None),
    "extract_task_rois": ("extract_task_rois", "custom_example"), "pretrain": ("pretrain", None),
    "finetune": ("finetune", "custom_example"), "evaluate": ("evaluate", "custom_example"),
    "custom_table": ("custom_table", None),
}

STAMP = re.compile(r"Measured\s+on\s+(\d{4}-\d{2}-\d{2})\s+at\s+commit\s+([0-9a-f]{7,40})\s+\(example\s+inputs\s+"
                   r"sha256\s+`([0-9a-f]{12})`")
# a row of the example's table: | none | 78.0 | 75.3 | 118 | p=... | 12 / 3 |
EXAMPLE_ROW = re.compile(r"^\| (none|full) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([^|]*) \| ([^|]*) \|$", re.MULTILINE)
README_NUMBERS = re.compile(r"accuracy\s+`none`\s+([\d.]+)\s+%,\s+`full`\s+([\d.]+)\s+%\s+\(McNemar\s+(p[=<][\d.]+)\)")


def example_inputs_fingerprint(repo: Path = REPO) -> str:
    """sha256 over the example's input files (path, then bytes, each) and the code fingerprint of each job of
    its DAG (rule, then fingerprint), first 12 hex digits."""
    digest = hashlib.sha256()
    for name in EXAMPLE_INPUTS:
        content = default_config_read_by_example(repo) if name == DEFAULT_CONFIG else (repo / name).read_bytes()
        digest.update(name.encode() + b"\0" + content + b"\0")
    # the example's own task must be registered for its jobs' fingerprints to leave the other tasks' code out
    added = [name for name in registry.register_config_tasks(read_yaml(repo / EXAMPLE_CONFIG))]
    try:
        for rule, (script, task) in sorted(EXAMPLE_JOBS.items()):
            fingerprint = code_fingerprint(repo, f"workflow/scripts/{script}.py", task)
            digest.update(f"{rule}\0{fingerprint}\0".encode())
    finally:
        for name in added:
            registry.unregister(name)
    return digest.hexdigest()[:12]


def default_config_read_by_example(repo: Path = REPO) -> bytes:
    """The default config as the example's jobs read it: canonical JSON, `finetune:` kept to its options and the
    example's own task."""
    config = read_yaml(repo / DEFAULT_CONFIG)
    kept = set(registry.FINETUNE_OPTIONS) | set(EXAMPLE_FINETUNE_TASKS)
    config["finetune"] = {key: value for key, value in config.get("finetune", {}).items() if key in kept}
    return json.dumps(config, sort_keys=True).encode()


def test_a_recipe_of_a_task_the_example_does_not_run_leaves_its_fingerprint_alone(tmp_path):
    """Lengthening VQA's fine-tuning cannot move the example's numbers; lengthening what every task shares can."""
    repo = tmp_path / "repo"
    (repo / DEFAULT_CONFIG).parent.mkdir(parents=True)
    shutil.copy(REPO / DEFAULT_CONFIG, repo / DEFAULT_CONFIG)
    before = default_config_read_by_example(repo)
    config = read_yaml(repo / DEFAULT_CONFIG)
    config["finetune"]["vqa"]["epochs"] += 1
    (repo / DEFAULT_CONFIG).write_text(yaml.safe_dump(config), encoding="utf-8")
    assert default_config_read_by_example(repo) == before
    config["finetune"]["schedules"]["full"] = 2.0
    (repo / DEFAULT_CONFIG).write_text(yaml.safe_dump(config), encoding="utf-8")
    assert default_config_read_by_example(repo) != before


def section(text: str, heading: str) -> str:
    """The text under a Markdown heading, up to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(heading)}$", text, re.MULTILINE)
    assert match, f"no section {heading!r}"
    body = text[match.end():]
    end = re.search(r"^#+ ", body, re.MULTILINE)
    return body[: end.start()] if end else body


def stamp() -> tuple[str, str, str]:
    found = STAMP.search(section(DOC.read_text(encoding="utf-8"), "The example"))
    assert found, (f"{DOC.name} 'The example' has no stamp 'Measured on YYYY-MM-DD at commit <hash> (example "
                   "inputs sha256 `<12 hex>`': the numbers must say what they were measured on")
    return found.groups()


def example_rows() -> dict[str, tuple[str, ...]]:
    rows = {m.group(1): m.groups()[1:] for m in EXAMPLE_ROW.finditer(section(DOC.read_text(encoding="utf-8"),
                                                                             "The example"))}
    assert set(rows) == {"none", "full"}, f"{DOC.name} 'The example': the table needs a none and a full row"
    return rows


def test_the_documented_numbers_carry_a_stamp_of_a_real_commit():
    date, commit, _ = stamp()
    assert datetime.date.fromisoformat(date) <= datetime.date.today()
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the stamp's commit cannot be looked up")
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone: the history that holds the stamp's commit is not here")
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{DOC.name}: the numbers' commit {commit} is not in this repository"


def test_the_example_did_not_change_since_its_numbers_were_measured():
    _, _, documented = stamp()
    current = example_inputs_fingerprint()
    assert current == documented, (
        f"{' and '.join(EXAMPLE_INPUTS)} changed since the numbers in {DOC.name} were measured (fingerprint "
        f"{current}, documented {documented}): run the example again, then update the numbers in {DOC.name} and "
        "README.md and the stamp")


def test_the_readme_states_the_documented_numbers():
    rows = example_rows()
    text = section(README.read_text(encoding="utf-8"), "Your own data")
    found = README_NUMBERS.search(text)
    assert found, "README 'Your own data' states no 'accuracy `none` X %, `full` Y % (McNemar p...)'"
    none, full, p = found.groups()
    assert (none, full) == (rows["none"][0], rows["full"][0])
    assert p == rows["full"][3].strip().replace(" ", "")
    assert "docs/own-data.md#" in text, "README 'Your own data' links no section of docs/own-data.md"
    date, commit, _ = stamp()
    assert re.search(rf"measured\s+{date}\s+at\s+{commit}\b", text), \
        f"README 'Your own data' does not say its numbers were measured {date} at {commit}, as {DOC.name} does"


def test_the_documented_p_values_follow_from_the_discordant_counts():
    """The example's row: p of McNemar with its counts of rows only `full` / only `none` gets right."""
    rows = example_rows()
    only_full, only_none = (int(n) for n in rows["full"][4].split("/"))
    correct_full = [1] * only_full + [0] * only_none
    correct_none = [0] * only_full + [1] * only_none
    assert format_p_value(mcnemar_exact(correct_full, correct_none)).replace(" ", "") == \
        rows["full"][3].strip().replace(" ", "")


def test_the_fingerprint_moves_with_the_example_config_and_with_the_code_its_jobs_run(tmp_path):
    """The check above can fail: one changed byte of the example config, or one changed line of a module the
    example's fine-tuning imports, gives another fingerprint; a module none of its jobs imports (the VQA head) does
    not."""
    shutil.copytree(REPO, tmp_path / "repo", ignore=shutil.ignore_patterns(
        ".git", ".venv", "results", "resources", "logs", ".snakemake", "__pycache__", "tests", "benchmarks", "docs"))
    repo = tmp_path / "repo"
    before = example_inputs_fingerprint(repo)
    config = repo / EXAMPLE_CONFIG
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("steps:", "steps: ", 1), encoding="utf-8")
    assert example_inputs_fingerprint(repo) != before
    config.write_text(text, encoding="utf-8")
    assert example_inputs_fingerprint(repo) == before
    for module, moves in (("vlbert_core/training.py", True), ("vlbert_core/tasks/modeling/vqa.py", False)):
        path = repo / module
        original = path.read_text(encoding="utf-8")
        path.write_text(original + "\nCHANGED = 1\n", encoding="utf-8")
        assert (example_inputs_fingerprint(repo) != before) is moves, module
        path.write_text(original, encoding="utf-8")


@pytest.mark.workflow
def test_the_fingerprint_covers_every_job_of_the_examples_dag(tmp_path):
    """EXAMPLE_JOBS lists exactly the rules Snakemake plans for the example (a dry run, every job forced)."""
    proc = snakemake(tmp_path, "-n", "-F", EXAMPLE_TARGET, "--configfile", str(REPO / EXAMPLE_CONFIG),
                     "--cores", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(planned_rules(proc.stdout)) == set(EXAMPLE_JOBS)
