"""Each example runs end to end on the real default model and a small corpus, offline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TTFT = re.compile(
    r"TTFT without ragkv:\s+[\d.]+ ms.*\n"
    r"\s+TTFT with ragkv:\s+[\d.]+ ms\s+\(chunks (\d+), cache hits (\d+)"
)

pytestmark = pytest.mark.slow


def run(*args: str, timeout: int = 300) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def corpus(tmp_path: Path) -> Path:
    """Two of the shipped documents: small enough for a quick run."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("honeybees.txt", "sourdough.txt"):
        (docs / name).write_text((EXAMPLES / "data" / name).read_text())
    return docs


def test_llamaindex_query_engine_example(tmp_path):
    pytest.importorskip("llama_index.core")
    out = run(
        str(EXAMPLES / "llamaindex_query_engine.py"),
        "--docs",
        str(corpus(tmp_path)),
        "--data-dir",
        str(tmp_path / "data"),
        "--question",
        "How do bees find flowers?",
        "--top-k",
        "2",
        "--max-new-tokens",
        "8",
    )
    ((chunks, hits),) = TTFT.findall(out)
    assert int(chunks) == 2 and int(hits) == 2, out


def test_langchain_lcel_chain_example(tmp_path):
    pytest.importorskip("langchain_core")
    out = run(
        str(EXAMPLES / "langchain_lcel_chain.py"),
        "--docs",
        str(corpus(tmp_path)),
        "--data-dir",
        str(tmp_path / "data"),
        "--question",
        "When does a starter peak?",
        "--k",
        "2",
        "--max-new-tokens",
        "8",
    )
    ((chunks, hits),) = TTFT.findall(out)
    assert int(chunks) == int(hits) == 2, out  # caches from index time: hits on the first question


def test_shared_store_example_answers_from_another_process(tmp_path):
    pytest.importorskip("langchain_core")
    data = str(tmp_path / "shared")
    out = run(str(EXAMPLES / "shared_store.py"), "index", "--data-dir", data, str(corpus(tmp_path)))
    assert "caches computed" in out
    out = run(
        str(EXAMPLES / "shared_store.py"),
        "answer",
        "--data-dir",
        data,
        "--k",
        "2",
        "--max-new-tokens",
        "8",
        "How do bees find flowers?",
    )
    ((chunks, hits),) = TTFT.findall(out)
    assert int(chunks) == int(hits) == 2 and "prefilled chunk tokens 0" in out, out
