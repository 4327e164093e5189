"""Text-only corpora (BooksCorpus, English Wikipedia) as webdataset shards of documents.

Each kept document becomes one sample: KEY.txt (its sentences, one per line) and KEY.json
(source, title, id, file). Documents are dealt to the shards round robin by their index among
the kept documents, so every shard gets an even share and the split is deterministic.

BooksCorpus: the published `books_large_p1.txt` is one sentence per line with no book
boundaries, so consecutive runs of `sentences_per_doc` non-blank lines form a document (a
pre-training sample only needs local coherence: it takes up to 64 tokens of one document). A
folder of per-book .txt files is also accepted; there, documents never cross a book boundary.

Wikipedia: `pages-articles*.xml.bz2` is stream-parsed (iterparse over bz2, each page cleared
once handled), so a full dump never sits in memory. Only namespace-0 articles that are not
redirects are kept. Markup is stripped with mwparserfromhell: templates, <ref>s, tables,
comments, galleries/math, File/Image/Category and interlanguage links and the section headings
are removed, as are the appendix sections (References, See also, External links...); link
labels and the text of formatting tags remain.

The accounting parquet has one row per input unit (page, or book document) with its status, and the size
and sha256 of every shard in its key-value metadata.
"""

from __future__ import annotations

import bz2
import contextlib
import json
import multiprocessing
import multiprocessing.pool
import os
import re
import tarfile
import zlib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import mwparserfromhell
import pyarrow as pa
from vlbert_core.progress import Progress

from vlbert_core.damaged import TEXT_SHARDS_METADATA_KEY, shard_record
from vlbert_core.data.writer import TarShardWriter, encode_json, text_key
from vlbert_core.parquet import AtomicParquetWriter
from vlbert_core.utils import get_logger

log = get_logger(__name__)

CORPORA = ("books", "wiki")
DEFAULT_SENTENCES_PER_DOC = 20

KEPT = "kept"
REDIRECT = "redirect"
NON_ARTICLE_NAMESPACE = "non_article_namespace"
EMPTY_AFTER_MARKUP = "empty_after_markup"
EMPTY_FILE = "empty_file"  # a per-book .txt with no non-blank line
TEXT_STATUSES = (KEPT, REDIRECT, NON_ARTICLE_NAMESPACE, EMPTY_AFTER_MARKUP, EMPTY_FILE)

ACCOUNTING_SCHEMA = pa.schema(
    [
        ("index", pa.int64()),  # position of the page / document in the input, from 0
        ("file", pa.string()),
        ("id", pa.string()),
        ("title", pa.string()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("key", pa.string()),  # "" unless kept
        ("shard", pa.int32()),  # -1 unless kept
        ("num_sentences", pa.int32()),
    ]
)


# -- sentences ----------------------------------------------------------------------------------

# A candidate boundary: terminal punctuation, optional closing quotes/brackets, whitespace, and
# the next sentence starting with an upper-case letter, a digit or an opening quote/bracket.
_BOUNDARY = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt ft no vol fig figs ed eds rev gen col lt sgt capt gov sen rep "
    "inc ltd co corp bros dept est approx ca cf vs etc al e.g i.e u.s u.k jan feb mar apr jun jul "
    "aug sep sept oct nov dec".split()
)
_HAS_LETTER = re.compile(r"[^\W\d_]")


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences with a punctuation rule that skips common abbreviations
    and initials ("Dr. Smith", "J. R. R. Tolkien", "e.g. this")."""
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        before = text[start : match.start() + 1].split()
        word = before[-1].lower().strip("\"'([") if before else ""
        if text[match.start()] == "." and (word[:-1] in _ABBREVIATIONS or re.fullmatch(r"[a-z]\.", word)):
            continue
        sentences.append(text[start : match.end()].strip())
        start = match.end()
    sentences.append(text[start:].strip())
    return [sentence for sentence in sentences if _HAS_LETTER.search(sentence)]


# -- wikitext -----------------------------------------------------------------------------------

_DROP_TAGS = frozenset(
    "ref references table gallery math chem timeline syntaxhighlight source pre score imagemap "
    "graph mapframe maplink templatedata nowiki hiero".split()
)
_DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
_INTERLANGUAGE = re.compile(r"^[a-z]{2,3}(-[a-z]+)*$")
_APPENDIX_SECTIONS = re.compile(
    r"(references|notes|footnotes|citations|sources|bibliography|see also|external links"
    r"|further reading|notes and references)",
    re.IGNORECASE,
)
_DROP_NODE_TYPES = (
    mwparserfromhell.nodes.Template,
    mwparserfromhell.nodes.Comment,
    mwparserfromhell.nodes.Heading,  # headings are titles, not sentences
    mwparserfromhell.nodes.Argument,
)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")
_SPACES = re.compile(r"[ \t\u00a0]+")


def _link_is_dropped(title: str) -> bool:
    prefix, colon, _ = title.strip().partition(":")
    if not colon or title.strip().startswith(":"):  # "[[:Category:X]]" is an ordinary inline link
        return False
    prefix = prefix.strip().lower()
    return prefix in _DROP_LINK_NAMESPACES or bool(_INTERLANGUAGE.match(prefix))


def _is_dropped(node) -> bool:
    if isinstance(node, _DROP_NODE_TYPES):
        return True
    if isinstance(node, mwparserfromhell.nodes.Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    if isinstance(node, mwparserfromhell.nodes.Wikilink):
        return _link_is_dropped(str(node.title))
    return False


def _prune(code, top_level: bool = False) -> None:
    """Drop unwanted nodes in place, in one pass over the tree (Wikicode.remove searches the whole
    tree per call, which is quadratic on long articles). At the top level, an appendix heading
    drops everything up to the next heading of the same or a higher level."""
    kept = []
    skip_below: int | None = None  # inside an appendix section of this heading level
    for node in code.nodes:
        if top_level and isinstance(node, mwparserfromhell.nodes.Heading):
            if skip_below is not None and node.level <= skip_below:
                skip_below = None
            if skip_below is None and _APPENDIX_SECTIONS.fullmatch(node.title.strip_code().strip()):
                skip_below = node.level
        if skip_below is not None or _is_dropped(node):
            continue
        for child in node.__children__():
            _prune(child)
        kept.append(node)
    code.nodes = kept


def strip_wikitext(wikitext: str) -> str:
    """Plain text of an article's wikitext, paragraphs and list items on their own lines."""
    code = mwparserfromhell.parse(wikitext)
    _prune(code, top_level=True)
    text = code.strip_code(normalize=True, collapse=True)
    lines = []
    for line in text.splitlines():
        line = _MAGIC_WORD.sub("", line)
        line = _EMPTY_BRACKETS.sub("", line)
        line = _SPACES.sub(" ", line)
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines)


def wikitext_to_sentences(wikitext: str) -> list[str]:
    """Sentences of an article, in order; paragraphs never run into each other."""
    # A one-word line is a leftover list entry or caption fragment, not prose.
    lines = [line for line in strip_wikitext(wikitext).splitlines() if len(line.split()) >= 2]
    return [sentence for line in lines for sentence in split_sentences(line)]


# -- input units --------------------------------------------------------------------------------


@dataclass
class TextUnit:
    """One page or book document: `sentences` when it is usable, else a status saying why not."""

    file: str
    id: str
    title: str
    status: str
    reason: str
    sentences: list[str]


@dataclass
class WikiPage:
    title: str
    ns: int
    id: str
    redirect: str | None  # redirect target, None for an article
    text: str


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def iter_wiki_pages(path: str | os.PathLike) -> Iterator[WikiPage]:
    """Stream the <page>s of a MediaWiki export (.xml or .xml.bz2), clearing each one after use."""
    path = Path(path)
    opener = bz2.open if path.suffix == ".bz2" else open
    pages = 0
    with opener(path, "rb") as handle:
        root = None
        try:
            for event, elem in ET.iterparse(handle, events=("start", "end")):
                if root is None:
                    root = elem
                    if _local(root.tag) != "mediawiki":
                        raise ValueError(f"{path}: root element is <{_local(root.tag)}>, not a MediaWiki export")
                if event != "end" or _local(elem.tag) != "page":
                    continue
                fields = {_local(child.tag): child for child in elem}
                title = (fields["title"].text or "").strip() if "title" in fields else ""
                if "ns" not in fields or not (fields["ns"].text or "").strip().lstrip("-").isdigit():
                    raise ValueError(f"{path}: page {title!r} has no numeric <ns> element")
                if "id" not in fields:
                    raise ValueError(f"{path}: page {title!r} has no <id> element")
                revisions = [child for child in elem if _local(child.tag) == "revision"]
                text = ""
                if revisions:
                    text_elem = next((c for c in revisions[-1] if _local(c.tag) == "text"), None)
                    text = (text_elem.text or "") if text_elem is not None else ""
                redirect = fields["redirect"].get("title", "") if "redirect" in fields else None
                yield WikiPage(title, int(fields["ns"].text), fields["id"].text.strip(), redirect, text)
                pages += 1
                elem.clear()
                root.clear()  # drop the handled pages from the tree: memory stays flat over a dump
        except ET.ParseError as err:
            raise ValueError(f"{path}: malformed XML after {pages} pages: {err}") from err
        except EOFError as err:  # bz2 stream cut short: an interrupted download
            raise ValueError(
                f"{path}: the file ends in the middle of its compressed stream after {pages} pages "
                f"(truncated download? fetch it again): {err}"
            ) from err
        except OSError as err:  # bz2 raises OSError("Invalid data stream") on corrupt bytes
            raise ValueError(f"{path}: cannot decompress after {pages} pages: {err}") from err


_REDIRECT_TEXT = re.compile(r"^\s*#redirect", re.IGNORECASE)


def wiki_page_unit(page: WikiPage, file: str) -> TextUnit:
    """Keep an article's sentences, or say why the page is not an article."""
    if page.ns != 0:
        return TextUnit(file, page.id, page.title, NON_ARTICLE_NAMESPACE, f"namespace {page.ns}", [])
    if page.redirect is not None or _REDIRECT_TEXT.match(page.text):
        target = page.redirect or page.text.strip()[:100]
        return TextUnit(file, page.id, page.title, REDIRECT, f"redirect to {target!r}", [])
    sentences = wikitext_to_sentences(page.text)
    if sentences:
        return TextUnit(file, page.id, page.title, KEPT, "", sentences)
    return TextUnit(file, page.id, page.title, EMPTY_AFTER_MARKUP, f"{len(page.text)} chars of wikitext, no sentence", [])


def _page_unit_args(args: tuple[WikiPage, str]) -> TextUnit:
    return wiki_page_unit(*args)


def wiki_units(path: str | os.PathLike, pool: multiprocessing.pool.Pool | None = None) -> Iterator[TextUnit]:
    """Units of a dump, in page order. Markup stripping is the cost (about 6.7M articles in
    enwiki), so with a pool it runs in worker processes while this one reads the XML."""
    name = Path(path).name
    pages = ((page, name) for page in iter_wiki_pages(path))
    if pool is None:
        yield from map(_page_unit_args, pages)
    else:
        yield from pool.imap(_page_unit_args, pages, chunksize=32)


def book_units(path: str | os.PathLike, lines: Iterable[bytes], sentences_per_doc: int, flat: bool) -> Iterator[TextUnit]:
    """Documents of `sentences_per_doc` consecutive non-blank `lines` of one text file `path`.

    `flat` (a BooksCorpus dump without book boundaries) titles documents by their line range;
    otherwise the file is one book and documents are numbered within it.
    """
    path = Path(path)
    chunk: list[str] = []
    first_line = 0
    blank = 0
    invalid_utf8 = 0
    part = 0

    def emit(last_line: int) -> TextUnit:
        doc_id = f"{path.stem}:{first_line}-{last_line}"
        title = f"{path.name} lines {first_line}-{last_line}" if flat else f"{path.stem} part {part}"
        reason = f"{blank} blank lines skipped" if blank else ""
        if invalid_utf8:
            reason = (reason + "; " if reason else "") + f"{invalid_utf8} lines with invalid UTF-8 (replaced)"
        return TextUnit(path.name, doc_id, title, KEPT, reason, list(chunk))

    line_number = 0
    for line_number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = raw.decode("utf-8", errors="replace")
            invalid_utf8 += 1
        line = line.strip()
        if not line:
            blank += 1
            continue
        if not chunk:
            first_line = line_number
        chunk.append(line)
        if len(chunk) == sentences_per_doc:
            yield emit(line_number)
            chunk, blank, invalid_utf8, part = [], 0, 0, part + 1
    if chunk:
        yield emit(line_number)
    elif part == 0:
        yield TextUnit(path.name, path.stem, path.stem, EMPTY_FILE, f"{line_number} lines, none with text", [])


_ARCHIVE_SUFFIXES = (".tar", ".tar.bz2", ".tbz2", ".tar.gz", ".tgz", ".tar.xz")


def _is_archive(path: Path) -> bool:
    return path.name.endswith(_ARCHIVE_SUFFIXES)


def _source_files(source: Path, corpus: str) -> list[Path]:
    if source.is_file():
        return [source]
    if source.is_dir():
        pattern = "*.txt" if corpus == "books" else "*pages-articles*.xml*"
        files = sorted(p for p in source.glob(pattern) if p.is_file())
        if not files:
            raise FileNotFoundError(f"{source}: folder holds no {pattern} files for corpus {corpus!r}")
        return files
    raise FileNotFoundError(f"{corpus} source {source} does not exist")


def archive_book_units(archive: Path, sentences_per_doc: int) -> Iterator[TextUnit]:
    """Book documents from the .txt members of a tar archive (the published BooksCorpus
    `bookcorpus.tar.bz2` holds books_large_p1.txt and books_large_p2.txt), read as a stream
    without unpacking it. Members come in archive order; other members are skipped."""
    txt_members = 0
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                if not (member.isfile() and member.name.endswith(".txt")):
                    continue
                txt_members += 1
                handle = tar.extractfile(member)
                yield from book_units(member.name, handle, sentences_per_doc, flat=True)
    except (tarfile.ReadError, EOFError, OSError, zlib.error) as err:
        raise ValueError(
            f"{archive}: cannot read the archive after {txt_members} .txt members "
            f"(truncated download? fetch it again): {type(err).__name__}: {err}"
        ) from err
    if txt_members == 0:
        raise ValueError(f"{archive}: the archive holds no .txt member")


def iter_text_units(
    corpus: str, source: str | os.PathLike, sentences_per_doc: int, pool: multiprocessing.pool.Pool | None = None
) -> Iterator[TextUnit]:
    """Every input unit of the corpus, in a deterministic order.

    books: a .txt file (one sentence per line), a folder of per-book .txt files, or a tar
    archive of .txt files. wiki: a pages-articles .xml(.bz2) dump, or a folder of them.
    """
    source = Path(source)
    if corpus == "books" and source.is_file() and _is_archive(source):
        yield from archive_book_units(source, sentences_per_doc)
        return
    for path in _source_files(source, corpus):
        if corpus == "books":
            with open(path, "rb") as handle:
                yield from book_units(path, handle, sentences_per_doc, flat=source.is_file())
        else:
            yield from wiki_units(path, pool)


# -- shards -------------------------------------------------------------------------------------


def shard_text_corpus(
    corpus: str,
    source: str | os.PathLike,
    out_tars: Sequence[str | os.PathLike],
    out_accounting: str | os.PathLike,
    sentences_per_doc: int = DEFAULT_SENTENCES_PER_DOC,
    processes: int = 1,
) -> dict[str, int]:
    """Write the corpus's documents round robin into `out_tars` (shard i = out_tars[i]) and the
    per-page/document accounting parquet, whose key-value metadata `vlbert_shards` holds each tar's size and
    sha256 (vlbert_core/damaged.py); return counts per status.

    With processes > 1, Wikipedia markup is stripped in that many worker processes; the output
    is the same bytes either way.
    """
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    if not out_tars:
        raise ValueError(f"{corpus}: no output tars given (num_shards must be >= 1)")
    if sentences_per_doc < 1:
        raise ValueError(f"sentences_per_doc must be >= 1, got {sentences_per_doc}")
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    num_shards = len(out_tars)
    counts = {name: 0 for name in TEXT_STATUSES}
    # enwiki has over 20M pages: rows go to the file 100k at a time
    with AtomicParquetWriter(out_accounting, ACCOUNTING_SCHEMA, rows_per_group=100_000) as accounting:
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(TarShardWriter(path)) for path in out_tars]
            pool = None
            if processes > 1 and corpus == "wiki":
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(processes))
            units = iter_text_units(corpus, source, sentences_per_doc, pool)
            unit_name = "doc" if corpus == "books" else "page"
            for index, unit in enumerate(Progress(units, desc=corpus, unit=unit_name, mininterval=2.0)):
                key, shard = "", -1
                if unit.status == KEPT:
                    kept = counts[KEPT]
                    key, shard = text_key(corpus, kept), kept % num_shards
                    meta = {"source": corpus, "file": unit.file, "title": unit.title, "id": unit.id}
                    writers[shard].write(key, {"txt": "\n".join(unit.sentences) + "\n", "json": encode_json(meta)})
                counts[unit.status] += 1
                accounting.add_row(
                    (index, unit.file, unit.id, unit.title, unit.status, unit.reason, key, shard, len(unit.sentences))
                )
            total = sum(counts.values())
            if counts[KEPT] == 0:
                raise ValueError(f"{source}: no {corpus} document survived parsing ({total} pages/documents read)")
            empty = [str(path) for path, writer in zip(out_tars, writers) if writer.count == 0]
            if empty:
                log.warning("%s: %d kept documents leave shards empty: %s", corpus, counts[KEPT], empty)
        # the tars are complete under their names: the accounting's footer records their sizes and checksums,
        # which their readers check (vlbert_core/damaged.py)
        records = {Path(path).name: shard_record(path) for path in out_tars}
        accounting.add_key_value_metadata({TEXT_SHARDS_METADATA_KEY: json.dumps(records, sort_keys=True)})
    log.info("%s from %s: %d units, %s; %d shards", corpus, source, total, counts, num_shards)
    return counts
