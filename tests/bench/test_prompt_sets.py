"""The ``packages`` prompt set: deterministic, answerable from one chunk, usable by the benches."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from typer.testing import CliRunner

from ragkv.bench import prompt_sets
from ragkv.bench.prompt_sets import clean_description, package_prompts, prompt_set
from ragkv.cli import app


class _ByteEncoder:
    """One token per UTF-8 byte, as the tiny test tokenizer counts."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _normal(text: str) -> str:
    return " ".join(text.split())


def test_the_set_is_the_same_every_time() -> None:
    first = package_prompts(_ByteEncoder(), n=8, max_tokens=2000)
    assert json.dumps(first) == json.dumps(package_prompts(_ByteEncoder(), n=8, max_tokens=2000))
    assert len(first) == 8 and len({p["question"] for p in first}) == 8  # eight different questions


def test_every_answer_sits_in_its_chunk_of_the_prompt() -> None:
    for p in package_prompts(_ByteEncoder(), n=12, max_tokens=2000):
        assert 2 <= len(p["chunks"]) <= 6 and sum(len(c.encode()) for c in p["chunks"]) <= 2000
        assert 0 <= p["answer_chunk"] < len(p["chunks"])
        blanked = p["question"].split('reads: "', 1)[1].rsplit('" Which word', 1)[0]
        assert blanked.count("____") == 1 and len(p["answer"]) >= 5
        sentence = blanked.replace("____", p["answer"])
        assert sentence in _normal(p["chunks"][p["answer_chunk"]])
        others = [c for i, c in enumerate(p["chunks"]) if i != p["answer_chunk"]]
        assert all(sentence not in _normal(c) for c in others)  # one chunk holds the answer


def test_chunks_come_from_several_packages_and_no_markup() -> None:
    prompts = package_prompts(_ByteEncoder(), n=12, max_tokens=2800)
    text = "".join(c for p in prompts for c in p["chunks"])
    assert "![" not in text and "http://" not in text and "https://" not in text and "<img" not in text
    named = {p["question"].split("Python package ")[1].split(".")[0] for p in prompts}
    assert len(named) >= 5


def test_cleaning_keeps_prose_and_drops_badges_links_and_html() -> None:
    md = "# Tool\n\n[![ci](https://x/b.svg)](https://x)\n<p align=center>Fast <b>thing</b></p>\n"
    md += "See [the docs](https://d) now.\n"
    rst = ".. image:: https://x/b.svg\n   :target: https://x\n\nRead `the guide <https://g>`_ and :func:`run`.\n"
    assert clean_description(md) == "# Tool\n\nFast thing\nSee the docs now.\n"
    assert clean_description(rst) == "Read the guide and run.\n"


def test_missing_packages_fail_with_a_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(prompt_sets.importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="install ragkv's dependencies .* or use --prompts builtin"):
        package_prompts(_ByteEncoder(), n=1)
    with pytest.raises(ValueError, match="unknown prompt set 'stdlib'"):
        prompt_set("stdlib", _ByteEncoder())


@pytest.mark.parametrize("bench", ["fusion", "codec"])
def test_the_benches_take_the_set_by_name(bench: str, llama_adapter, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr("ragkv.cli.bench._load_model", lambda *a, **k: llama_adapter)
    out = tmp_path / "rows.json"
    extra = ["--methods", "naive,query_focus:0.15"] if bench == "fusion" else []
    result = CliRunner().invoke(
        app, ["bench", bench, "--prompts", "packages", "--limit", "1", "--json", str(out), *extra]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert rows and all(r["kl"] > -1e-5 for r in rows)  # raw: 0 within rounding
    if bench == "fusion":
        assert {r["method"] for r in rows} == {"naive", "query_focus", "full"}


def test_an_unknown_set_is_refused_with_the_choices(llama_adapter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ragkv.cli.bench._load_model", lambda *a, **k: llama_adapter)
    result = CliRunner().invoke(app, ["bench", "codec", "--prompts", "stdlib"])
    assert result.exit_code == 2
    assert "neither a prompt set (builtin, packages) nor a JSONL file" in " ".join(
        result.output.replace("│", " ").split()
    )
