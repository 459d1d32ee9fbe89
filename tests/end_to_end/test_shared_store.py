"""Two processes, one Redis store and one PostgreSQL catalog: B never prefills what A indexed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.postgres]

TEXT = (
    "The heapq module provides an implementation of the heap queue algorithm, also known as the "
    "priority queue algorithm. heappush(heap, item) pushes the value item onto the heap, "
    "maintaining the heap invariant. heappop(heap) pops and returns the smallest item.\n\n"
) * 4


def test_index_in_one_process_answer_in_another(tmp_path, redis_url, postgres_url):
    (tmp_path / "doc.txt").write_text(TEXT)
    shared = ["--store", redis_url, "--catalog", postgres_url]
    cli = [sys.executable, "-m", "ragkv.cli"]
    env = dict(os.environ)
    # each process has its own data dir: they share nothing but Redis and the catalog
    a = subprocess.run(
        [*cli, "index", str(tmp_path / "doc.txt"), "--data-dir", str(tmp_path / "a"), *shared],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert a.returncode == 0, a.stderr
    b = subprocess.run(
        [
            *cli,
            "ask",
            "--json",
            "--max-new-tokens",
            "12",
            "--data-dir",
            str(tmp_path / "b"),
            *shared,
            "What does heappush do?",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert b.returncode == 0, b.stderr
    stats = json.loads(b.stdout.strip().splitlines()[-1])["stats"]
    assert stats["prefilled_chunk_tokens"] == 0
    assert stats["cache_hits"] >= 1 and stats["cache_misses"] == 0 and stats["bytes_loaded"] > 0
