"""vlbert_core.fingerprint: which edits change which stage's code fingerprint."""

import shutil
from pathlib import Path

import pytest

from vlbert_core.fingerprint import code_files, code_fingerprint, task_family

REPO = Path(__file__).resolve().parents[2]
JOBS = {  # (script, task) of the jobs whose fingerprints the edits below are checked against
    "download_cc": ("download_cc", None),
    "pretrain": ("pretrain", None),
    "finetune_vqa": ("finetune", "vqa"),
    "finetune_vcr": ("finetune", "vcr_q2a"),
    "finetune_refcoco": ("finetune", "refcoco"),
    "evaluate_vqa": ("evaluate", "vqa"),
    "evaluate_refcoco": ("evaluate", "refcoco_det"),
    "derive_q2ar": ("derive_eval", "vcr_q2ar"),
    "tables": ("tables", None),
}


@pytest.fixture()
def tree(tmp_path):
    shutil.copytree(REPO / "vlbert_core", tmp_path / "vlbert_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "workflow" / "scripts", tmp_path / "workflow" / "scripts")
    return tmp_path


def fingerprints(root: Path) -> dict[str, str]:
    return {job: code_fingerprint(root, f"workflow/scripts/{script}.py", task) for job, (script, task) in JOBS.items()}


def changed_after(root: Path, relative: str, edit) -> set[str]:
    before = fingerprints(root)
    path = root / relative
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    after = fingerprints(root)
    return {job for job in JOBS if before[job] != after[job]}


def test_editing_the_vqa_head_changes_only_vqa_jobs(tree):
    changed = changed_after(tree, "vlbert_core/tasks/modeling/vqa.py", lambda s: s.replace("inner = 2 * hidden_size", "inner = 3 * hidden_size"))
    assert changed == {"finetune_vqa"}


def test_editing_the_vqa_answer_normalisation_changes_vqa_finetune_and_evaluation(tree):
    changed = changed_after(tree, "vlbert_core/tasks/vqa.py", lambda s: s + "\nEXTRA_ANSWER_RULE = True\n")
    # the tables read each task's columns and per-example outcomes from its module
    assert changed == {"finetune_vqa", "evaluate_vqa", "tables"}


def test_editing_the_vcr_metric_changes_vcr_jobs_the_derived_q2ar_and_the_tables_only(tree):
    changed = changed_after(tree, "vlbert_core/tasks/vcr.py", lambda s: s + "\nEXTRA_VCR_RULE = True\n")
    # the tables read each task's columns and per-example outcomes from its module
    assert changed == {"finetune_vcr", "derive_q2ar", "tables"}


def test_editing_the_downloader_changes_the_download_jobs_only(tree):
    changed = changed_after(tree, "vlbert_core/data/downloader.py", lambda s: s + "\nRETRY_NOTE = 1\n")
    assert changed == {"download_cc"}


def test_editing_the_model_changes_pretraining_and_every_finetune(tree):
    changed = changed_after(tree, "vlbert_core/models/common/encoder.py", lambda s: s + "\nEXTRA = 1\n")
    assert {"pretrain", "finetune_vqa", "finetune_vcr", "finetune_refcoco"} <= changed
    assert not changed & {"download_cc", "evaluate_vqa", "evaluate_refcoco"}


def test_comment_and_blank_line_edits_change_nothing(tree):
    changed = changed_after(
        tree, "vlbert_core/tasks/modeling/vqa.py", lambda s: "# a note on the head\n\n" + s.replace("\n\n", "\n\n\n   \n", 1)
    )
    assert changed == set()


def test_relative_and_function_level_imports_are_followed(tree):
    files = {str(p.relative_to(tree)) for p in code_files(tree, "workflow/scripts/finetune.py")}
    assert {"vlbert_core/tasks/modeling/vqa.py", "vlbert_core/tasks/vcr.py", "vlbert_core/tasks/__init__.py",
            "vlbert_core/models/common/encoder.py", "workflow/scripts/finetune.py"} <= files
    assert "vlbert_core/data/downloader.py" not in files
    (tree / "vlbert_core" / "tasks" / "lazy.py").write_text("VALUE = 1\n")
    finetune = tree / "vlbert_core" / "tasks" / "finetune.py"
    finetune.write_text(finetune.read_text() + "\n\ndef _late():\n    from . import lazy\n    return lazy\n")
    assert tree / "vlbert_core" / "tasks" / "lazy.py" in code_files(tree, "workflow/scripts/finetune.py")


def test_task_families():
    assert [task_family(t) for t in ("vcr_q2a", "vcr_qa2r", "vcr_q2ar", "vqa", "refcoco", "refcoco_det")] == [
        "vcr", "vcr", "vcr", "vqa", "refcoco", "refcoco"]
    with pytest.raises(ValueError, match="gqa"):
        task_family("gqa")


def test_every_rule_that_runs_a_script_passes_its_code_fingerprint():
    """A rule without `code=` would not re-run when the library code under its script changes."""
    import re

    missing = []
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        # A rule's block runs from its `rule` line to the next one (or the end of the file).
        for block in re.split(r"^\s*rule ", smk.read_text(), flags=re.M)[1:]:
            name = block.split(":", 1)[0]
            if re.search(r"^\s+script:", block, flags=re.M) and not re.search(r"^\s+code=", block, flags=re.M):
                missing.append(f"{smk.name}: rule {name}")
    assert not missing, f"rules that run a script without a `code=` param: {missing}"


def test_a_name_a_lazy_package_loads_on_use_brings_its_submodule(tree):
    """`from vlbert_core.detector import train_detector` runs detector/train.py (detector/__init__.py loads it
    on first use through its `_SUBMODULE_OF` table): editing it must re-run the detector's training, and
    editing the RoI selection the RoI extraction."""
    def jobs():
        return {script: code_fingerprint(tree, f"workflow/scripts/{script}.py")
                for script in ("train_detector", "extract_rois", "pretrain")}

    before = jobs()
    train = tree / "vlbert_core" / "detector" / "train.py"
    train.write_text(train.read_text(encoding="utf-8") + "\nEXTRA = 1\n", encoding="utf-8")
    after = jobs()
    assert after["train_detector"] != before["train_detector"]
    select = tree / "vlbert_core" / "detector" / "select.py"
    select.write_text(select.read_text(encoding="utf-8") + "\nEXTRA = 1\n", encoding="utf-8")
    assert jobs()["extract_rois"] != after["extract_rois"]
    files = {str(p.relative_to(tree)) for p in code_files(tree, "workflow/scripts/train_detector.py")}
    assert {"vlbert_core/detector/train.py", "vlbert_core/detector/faster_rcnn.py"} <= files
