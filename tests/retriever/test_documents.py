"""load_documents: text formats, binary and empty files, directories, missing paths."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ragkv.retriever.documents import Document, document_source, html_to_text, load_documents

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


@pytest.fixture
def mixed_dir(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    write(root / "a.txt", "Plain text.\n")
    write(root / "b.md", "Intro line\n\n# The Title\n\nBody.\n")
    write(
        root / "sub" / "c.html",
        (
            "<html><head><title>Page  Title</title><style>p {color: red}</style></head>"
            "<body><h1>Header</h1><p>Fish &amp; chips</p><script>alert(1)</script><p>End</p></body></html>"
        ),
    )
    write(root / "sub" / "d.py", "def f():\n    return 1\n")
    write(root / "sub" / "deeper" / "e.rst", "RST Title\n=========\n\nText.\n")
    write(root / "notes.cfg", "[section]\nkey = value\n")  # unknown suffix, but UTF-8 text
    write(root / "image.png", PNG)
    write(root / "latin1.txt", "caf\xe9".encode("latin-1"))  # not UTF-8
    write(root / "empty.txt", "")
    write(root / "blank.md", "  \n\n\t\n")
    write(root / ".hidden.txt", "hidden")
    write(root / ".git" / "config", "[core]\n")
    return root


def test_directory_with_mixed_files(mixed_dir: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="ragkv.retriever.documents"):
        docs = load_documents([mixed_dir])
    names = [Path(d.source).relative_to(mixed_dir).as_posix() for d in docs]
    assert names == ["a.txt", "b.md", "notes.cfg", "sub/c.html", "sub/d.py", "sub/deeper/e.rst"]
    by_name = dict(zip(names, docs, strict=True))
    assert by_name["a.txt"] == Document(str(mixed_dir / "a.txt"), "Plain text.\n", "a")
    assert by_name["b.md"].title == "The Title"
    assert by_name["sub/deeper/e.rst"].title == "RST Title"
    html = by_name["sub/c.html"]
    assert html.title == "Page Title"
    assert html.text == "Header\n\nFish & chips\n\nEnd\n"
    assert by_name["sub/d.py"].text == "def f():\n    return 1\n"
    skipped = caplog.text
    for name in ("image.png", "latin1.txt", "empty.txt", "blank.md"):
        assert f"skipping {mixed_dir / name}" in skipped
    assert "hidden" not in " ".join(d.text for d in docs)


def test_glob_filters_directory(mixed_dir: Path):
    docs = load_documents([mixed_dir], glob="**/*.md")
    assert [Path(d.source).name for d in docs] == ["b.md"]
    docs = load_documents([mixed_dir], glob="*.txt")  # not recursive
    assert [Path(d.source).name for d in docs] == ["a.txt"]


@pytest.mark.parametrize("data", [PNG, b"text then \x00 nul", b"\xff\xfe\xfa not utf-8"])
def test_named_binary_file_is_an_error(tmp_path: Path, data: bytes):
    path = write(tmp_path / "file.bin", data)
    with pytest.raises(ValueError, match=r"file\.bin looks binary; ragkv indexes text files \(\.txt, \.md"):
        load_documents([path])


@pytest.mark.parametrize("data", ["", " \n\n "])
def test_named_empty_file_is_an_error(tmp_path: Path, data: str):
    path = write(tmp_path / "empty.md", data)
    with pytest.raises(ValueError, match=r"empty\.md is empty"):
        load_documents([path])


def test_named_html_without_text_is_empty(tmp_path: Path):
    path = write(tmp_path / "x.html", "<html><head><title>t</title></head><body><script>1</script></body></html>")
    with pytest.raises(ValueError, match="is empty"):
        load_documents([path])


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "nope" / "file.txt"
    with pytest.raises(FileNotFoundError, match=str(missing).replace("\\", "\\\\")):
        load_documents([missing])


def test_directory_without_text_files_is_an_error(tmp_path: Path):
    write(tmp_path / "d" / "x.png", PNG)
    with pytest.raises(ValueError, match="holds no readable text file"):
        load_documents([tmp_path / "d"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no readable text file"):
        load_documents([tmp_path / "empty_dir"])


def test_files_are_loaded_once_and_in_argument_order(mixed_dir: Path):
    a, b = mixed_dir / "a.txt", mixed_dir / "b.md"
    docs = load_documents([b, a, str(a), mixed_dir])
    sources = [d.source for d in docs]
    assert sources[:2] == [str(b), str(a)]
    assert len(sources) == len(set(sources)) == 6
    # A directory whose files all came through earlier arguments is not an error.
    assert load_documents([a, mixed_dir / "sub" / "deeper" / "e.rst", mixed_dir / "sub" / "deeper"])


def test_three_spellings_of_one_directory_give_the_same_sources(
    mixed_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`corpus/`, `./corpus/` and `/abs/corpus/` used to index every file three times."""
    monkeypatch.chdir(mixed_dir.parent)
    spellings = ["docs/", "./docs/", str(mixed_dir.resolve()) + "/"]
    loaded = [[d.source for d in load_documents([p])] for p in spellings]
    assert loaded[0] == loaded[1] == loaded[2]
    assert all(Path(s).is_absolute() and Path(s).resolve() == Path(s) for s in loaded[0])
    (tmp := mixed_dir.parent / "link").symlink_to(mixed_dir)
    assert [d.source for d in load_documents([tmp])] == loaded[0]


def test_a_user_given_source_is_kept_stripped_and_must_not_be_empty() -> None:
    assert document_source(Document(" wiki:Paris\n", "text", "Paris")) == "wiki:Paris"
    assert document_source(Document("notes/a.txt", "text", "a")) == "notes/a.txt"  # not resolved
    with pytest.raises(ValueError, match="empty source"):
        document_source(Document(" \t", "text", "untitled"))


def test_newlines_and_bom_are_normalized(tmp_path: Path):
    path = write(tmp_path / "win.txt", b"\xef\xbb\xbfline one\r\nline two\rline three\n")
    (doc,) = load_documents([path])
    assert doc.text == "line one\nline two\nline three\n"


def test_single_path_must_be_wrapped(tmp_path: Path):
    path = write(tmp_path / "a.txt", "x")
    with pytest.raises(TypeError, match="wrap the single path"):
        load_documents(str(path))  # type: ignore[arg-type]


def test_doc_id_depends_on_source_and_text():
    a = Document("a.txt", "same", "a")
    assert a.doc_id == Document("a.txt", "same", "other title").doc_id
    assert a.doc_id != Document("b.txt", "same", "a").doc_id
    assert a.doc_id != Document("a.txt", "changed", "a").doc_id
    assert len(a.doc_id) == 64


def test_html_to_text_keeps_block_structure():
    text, title = html_to_text("<div>one<br>two</div><ul><li>x</li><li>y</li></ul>")
    assert title is None
    assert text == "one\ntwo\n\nx\n\ny\n"
