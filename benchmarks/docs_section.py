"""One place that writes a benchmark's section of docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def replace_section(heading: str, body: str, docs: Path = DOCS) -> None:
    """Replace the body under `heading` (a '## ...' line) up to the next '## ' heading; append the
    section at the end if the file does not have it yet."""
    text = docs.read_text()
    start = text.find(heading + "\n")
    if start == -1:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{body.strip()}\n"
    else:
        body_start = start + len(heading)
        following = text.find("\n## ", body_start)
        end = len(text) if following == -1 else following + 1
        text = text[:body_start] + "\n\n" + body.strip() + "\n" + ("\n" if following != -1 else "") + text[end:]
    docs.write_text(text)
    print(f"wrote {docs} ({heading})", file=sys.stderr)
