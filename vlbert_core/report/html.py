"""Small HTML helpers: escaping, tables and the Markdown subset that the tables rule writes."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def inline_markdown(text: str) -> str:
    """`**bold**` and `` `code` `` of already-unescaped text, as HTML."""
    out = esc(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


NUMBER = re.compile(r"[-+]?\d[\d.]*(e[-+]?\d+)?|–")


def html_table(header: Iterable, rows: Iterable[Iterable]) -> str:
    """A plain HTML table; numbers (and `–`, no number) are right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{esc(c)}</td>' if NUMBER.fullmatch(str(c)) else f"<td>{esc(c)}</td>" for c in row
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _split_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def markdown_to_html(text: str, heading_level: int = 3) -> str:
    """The Markdown the tables rule writes, as HTML: `#` headings, pipe tables, `- ` lists, paragraphs.

    It is not a general Markdown converter; it covers exactly the constructs of
    vlbert_core.tables.build.markdown_table, and keeps any other line as a paragraph.
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = min(6, heading_level + len(line) - len(line.lstrip("#")) - 1)
            out.append(f"<h{level}>{inline_markdown(line.lstrip('#').strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            header = _split_cells(block[0])
            body = [_split_cells(b) for b in block[1:] if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*", b)]
            head = "".join(f"<th>{inline_markdown(h)}</th>" for h in header)
            rows = "".join("<tr>" + "".join(f"<td>{inline_markdown(c)}</td>" for c in row) + "</tr>" for row in body)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{inline_markdown(lines[i][2:])}</li>")
                i += 1
            out.append(f"<ul>{''.join(items)}</ul>")
        else:
            out.append(f"<p>{inline_markdown(line)}</p>")
            i += 1
    return "\n".join(out)
