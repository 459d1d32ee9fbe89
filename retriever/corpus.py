"""The demo corpus: standard-library documentation rendered by pydoc.

It needs no download and exists wherever Python does. pydoc's output carries a few details that
vary by machine (the path of each module's file, the docs URL, memory addresses in default
values); they are removed, so for a given Python version the corpus is the same everywhere.
"""

from __future__ import annotations

import importlib
import logging
import pydoc
import re
from collections.abc import Sequence

from ragkv.retriever.documents import Document

__all__ = ["stdlib_corpus", "DEFAULT_MODULES", "DEMO_QUESTIONS"]

logger = logging.getLogger(__name__)

# Modules whose docs are informative, varied, and small enough (3k to 25k characters each,
# about 130k in all) to index in a demo.
DEFAULT_MODULES: tuple[str, ...] = (
    "json",
    "csv",
    "heapq",
    "bisect",
    "textwrap",
    "functools",
    "statistics",
    "string",
    "shutil",
    "base64",
)

# Each is answered by a passage of the docs above.
DEMO_QUESTIONS: list[str] = [
    "What does json.dumps do with the indent argument?",
    "How does heapq.heappush work?",
    "What is the difference between statistics.median_low and statistics.median_high?",
    "How do I remove common leading whitespace from every line of a string with textwrap?",
    "What does functools.lru_cache do when maxsize is None?",
    "Which function in shutil copies a whole directory tree?",
]

# Sections that describe the machine, not the module.
_DROP_SECTIONS = frozenset({"MODULE REFERENCE", "FILE"})
_SECTION = re.compile(r"^([A-Z][A-Z ]*[A-Z])$")
_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+")


def stdlib_corpus(modules: Sequence[str] = DEFAULT_MODULES, max_chars_per_module: int | None = None) -> list[Document]:
    """Documents built from standard-library modules' pydoc text.

    Args:
        modules: Importable module names.
        max_chars_per_module: Cut each document to at most this many characters (at a line end).

    Returns:
        One ``Document`` per module, with source ``"pydoc:<module>"`` and a title from its NAME line.

    Raises:
        ValueError: If a module cannot be imported, or ``max_chars_per_module`` is not positive.
    """
    if isinstance(modules, str):
        raise TypeError(f"modules takes a list of names; wrap the single name: [{modules!r}]")
    if max_chars_per_module is not None and max_chars_per_module < 1:
        raise ValueError(f"max_chars_per_module must be >= 1 or None; got {max_chars_per_module}")
    docs = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"cannot import module {name!r} for the corpus ({e}); pass importable names") from e
        text = clean_pydoc(pydoc.render_doc(module, renderer=pydoc.plaintext))  # type: ignore[attr-defined]
        if max_chars_per_module is not None and len(text) > max_chars_per_module:
            text = _truncate(text, max_chars_per_module)
        docs.append(Document(source=f"pydoc:{name}", text=text, title=_title(text, name)))
    logger.debug("built stdlib corpus: %d documents, %d chars", len(docs), sum(len(d.text) for d in docs))
    return docs


def clean_pydoc(text: str) -> str:
    """Remove the machine-specific parts of pydoc's plain-text rendering.

    Drops the "Python Library Documentation" banner, the MODULE REFERENCE and FILE sections,
    memory addresses, and ``__dunder__`` entries of the DATA section.

    >>> clean_pydoc("Python Library Documentation: module m\\n\\nNAME\\n    m\\n\\nFILE\\n    /x/m.py\\n\\n")
    'NAME\\n    m\\n'
    """
    out: list[str] = []
    section = ""
    for line in text.splitlines():
        header = _SECTION.match(line)
        if header:
            section = header.group(1)
        if section in _DROP_SECTIONS or line.startswith("Python Library Documentation:"):
            continue
        if section == "DATA" and line.startswith("    __"):
            continue
        out.append(_ADDRESS.sub("", line.rstrip()))
    cleaned = "\n".join(out).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", cleaned) + "\n"


def _truncate(text: str, limit: int) -> str:
    cut = text.rfind("\n", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit]


def _title(text: str, name: str) -> str:
    """The line under NAME, e.g. ``"heapq - Heap queue algorithm (a.k.a. priority queue)."``."""
    match = re.search(r"^NAME\n\s+(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else name
