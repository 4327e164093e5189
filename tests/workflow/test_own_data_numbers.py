"""The own-data example's documented numbers (README "Your own data", docs/own-data.md) cannot go stale
silently (issue #40).

docs/own-data.md states the numbers that `config/own_data_example.yaml` gives, with a stamp: the date and
commit they were measured at, and a fingerprint of the example's own inputs (the example config and the
world's example generator). These tests fail when

- the stamp is missing, or names a commit this repository does not have;
- the example config or the generator changed after the measurement (their fingerprint differs): run the
  example again and update the numbers and the stamp;
- the README's numbers, or the date and commit it names, differ from docs/own-data.md's;
- a documented p-value does not follow from the documented counts of discordant rows.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vlbert_core.stats import format_p_value, mcnemar_exact

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "own-data.md"
README = REPO / "README.md"
# What decides the example's numbers beyond the default config: the files of the example itself.
EXAMPLE_INPUTS = ("config/own_data_example.yaml", "vlbert_core/world/custom_example.py")

STAMP = re.compile(r"Measured\s+on\s+(\d{4}-\d{2}-\d{2})\s+at\s+commit\s+([0-9a-f]{7,40})\s+\(example\s+inputs\s+"
                   r"sha256\s+`([0-9a-f]{12})`")
# a row of the example's table: | none | 78.0 | 75.3 | 118 | p=... | 12 / 3 |
EXAMPLE_ROW = re.compile(r"^\| (none|full) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([^|]*) \| ([^|]*) \|$", re.MULTILINE)
README_NUMBERS = re.compile(r"accuracy\s+`none`\s+([\d.]+)\s+%,\s+`full`\s+([\d.]+)\s+%\s+\(McNemar\s+(p[=<][\d.]+)\)")


def example_inputs_fingerprint(repo: Path = REPO) -> str:
    """sha256 over the example's input files (path, then bytes, each), first 12 hex digits."""
    digest = hashlib.sha256()
    for name in EXAMPLE_INPUTS:
        digest.update(name.encode() + b"\0" + (repo / name).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


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


def test_the_fingerprint_moves_with_the_example_config(tmp_path):
    """The check above can fail: one changed byte of the example config gives another fingerprint."""
    for name in EXAMPLE_INPUTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((REPO / name).read_bytes())
    before = example_inputs_fingerprint(tmp_path)
    config = tmp_path / EXAMPLE_INPUTS[0]
    config.write_text(config.read_text(encoding="utf-8").replace("steps:", "steps: ", 1), encoding="utf-8")
    assert example_inputs_fingerprint(tmp_path) != before
