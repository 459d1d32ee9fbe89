"""Loading documents from files and directories.

A path named by the caller is held to a higher standard than a file found while walking a
directory: a named file that is binary or empty is an error (the caller asked for it), while the
same file inside a directory is skipped with a log line (directories hold all sorts of things).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ragkv.digests import Digest, fields_digest

__all__ = ["Document", "load_documents", "document_source", "TEXT_SUFFIXES"]

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".html", ".htm")
"""Suffixes read as text without sniffing; any other file is read if it decodes as UTF-8."""

_HTML_SUFFIXES = (".html", ".htm")
_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a file as binary (as git does)


@dataclass(frozen=True, slots=True)
class Document:
    """One source text to be chunked and indexed."""

    source: str  # its id: a file's resolved absolute path, or a name such as "pydoc:json"
    text: str  # the full text, newlines normalized to "\n"
    title: str  # a human-readable title (first heading, <title>, or the file name)

    @property
    def doc_id(self) -> Digest:
        """sha256 over source and text: the same file with new content is a new document."""
        return fields_digest([("source", self.source), ("text", self.text)])


def document_source(doc: Document) -> str:
    """``doc``'s id in the catalog: its source, stripped (a user-given name is kept as given).

    >>> document_source(Document("  pydoc:json ", "text", "json"))
    'pydoc:json'

    Raises:
        ValueError: the source is empty.
    """
    source = doc.source.strip()
    if not source:
        raise ValueError(
            f"document {doc.title!r} has an empty source; give every Document a source that names it "
            "(a path or an id such as 'wiki:Paris'): re-indexing the same source replaces it"
        )
    return source


class _BinaryFileError(ValueError):
    """A file that is not UTF-8 text (internal: turned into a message or a skip)."""


class _EmptyFileError(ValueError):
    """A file with no text (internal: turned into a message or a skip)."""


def load_documents(paths: Sequence[str | Path], *, glob: str = "**/*") -> list[Document]:
    """Read text documents from files and directories.

    Directories are walked with ``glob`` (recursive by default) in sorted order; hidden files and
    directories (names starting with ".") are skipped. HTML is reduced to its visible text. Each
    file is loaded once even if several arguments reach it. A file's source is its resolved
    absolute path, so ``corpus/``, ``./corpus/`` and ``/abs/corpus/`` name the same documents.

    Args:
        paths: Files and/or directories.
        glob: Pattern applied inside each directory, e.g. ``"**/*.md"``.

    Returns:
        The documents, in argument order and sorted within each directory.

    Raises:
        FileNotFoundError: If a path does not exist.
        ValueError: If a named file is binary or empty, or a named directory holds no text file.
    """
    if isinstance(paths, str | Path):
        raise TypeError(f"load_documents takes a list of paths; wrap the single path: [{str(paths)!r}]")
    docs: list[Document] = []
    seen: set[Path] = set()  # resolved paths of the files loaded so far
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory (given to load_documents)")
        if path.is_dir():
            found = _load_directory(path, glob, seen)
            if not found and not _all_seen(path, glob, seen):
                raise ValueError(
                    f"{path} holds no readable text file matching {glob!r}; ragkv indexes text "
                    f"files ({', '.join(TEXT_SUFFIXES)}, ...). Check the path or the glob."
                )
            docs.extend(found)
        elif path.resolve() not in seen:
            seen.add(path.resolve())
            try:
                docs.append(_read_document(path))
            except (_BinaryFileError, _EmptyFileError) as e:
                raise ValueError(str(e)) from None
    return docs


def _load_directory(root: Path, glob: str, seen: set[Path]) -> list[Document]:
    """Documents under ``root``; binary, empty and unreadable files are logged and skipped."""
    docs: list[Document] = []
    for path in _walk(root, glob):
        resolved = path.resolve()
        if resolved in seen:
            continue
        try:
            docs.append(_read_document(path))
        except (_BinaryFileError, _EmptyFileError, OSError) as e:
            logger.info("skipping %s: %s", path, e)
        else:
            seen.add(resolved)
    return docs


def _walk(root: Path, glob: str) -> Iterator[Path]:
    """Regular, non-hidden files under ``root`` matching ``glob``, sorted."""
    for path in sorted(root.glob(glob)):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            yield path


def _all_seen(root: Path, glob: str, seen: set[Path]) -> bool:
    """True if ``root`` has files and all of them were already loaded through an earlier argument."""
    files = [p.resolve() for p in _walk(root, glob)]
    return bool(files) and all(p in seen for p in files)


def _read_document(path: Path) -> Document:
    """Read one file as a ``Document``; raises the internal errors for binary and empty files."""
    data = path.read_bytes()
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise _BinaryFileError(_binary_message(path))
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _BinaryFileError(_binary_message(path)) from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    title = path.stem
    if path.suffix.lower() in _HTML_SUFFIXES:
        text, html_title = html_to_text(text)
        title = html_title or title
    elif path.suffix.lower() in (".md", ".rst"):
        title = _first_heading(text) or title
    if not text.strip():
        raise _EmptyFileError(f"{path} is empty (no text to index); remove it from the list or add content")
    # The resolved path is the document's id: two spellings of one file must not make two documents.
    return Document(source=str(path.resolve()), text=text, title=title)


def _binary_message(path: Path) -> str:
    return (
        f"{path} looks binary; ragkv indexes text files ({', '.join(TEXT_SUFFIXES)}, or any UTF-8 "
        "text). Convert it to text first or leave it out."
    )


_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_RST_HEADING = re.compile(r"^(\S[^\n]*)\n([=\-~^\"'`#*+])\2{2,}\s*$", re.MULTILINE)


def _first_heading(text: str) -> str | None:
    """The first Markdown ATX heading or reStructuredText underlined title, if any."""
    found = [m for m in (_MD_HEADING.search(text), _RST_HEADING.search(text)) if m]
    if not found:
        return None
    return min(found, key=lambda m: m.start()).group(1).strip()


class _TextExtractor(HTMLParser):
    """Collects visible text, with line breaks where block elements start and end."""

    _BLOCK = frozenset(
        ("p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table", "pre")
        + ("blockquote", "section", "article", "header", "footer", "dd", "dt")
    )
    _HIDDEN = frozenset(("script", "style", "head", "noscript", "template"))

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title: list[str] = []
        self._hidden = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in self._HIDDEN:
            self._hidden += 1
        elif tag in self._BLOCK:
            self.parts.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in self._HIDDEN:
            self._hidden = max(0, self._hidden - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title.append(data)
        elif not self._hidden:
            self.parts.append(data)


def html_to_text(html: str) -> tuple[str, str | None]:
    """Visible text of an HTML page and its ``<title>``.

    >>> html_to_text("<html><head><title>T</title></head><body><p>a &amp; b</p><p>c</p></body></html>")
    ('a & b\\n\\nc\\n', 'T')
    """
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts)
    # Collapse the runs of blank lines and indentation that markup leaves behind.
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    title = " ".join("".join(parser.title).split()) or None
    return (text + "\n" if text else ""), title
