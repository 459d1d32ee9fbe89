"""The import direction (tools/layers.py, also run by ``make lint``): rooms import only downward."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("layers", ROOT / "tools" / "layers.py")
assert spec and spec.loader
layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layers)


def test_the_package_imports_point_down_only():
    assert layers.violations() == []


def test_every_module_of_the_package_is_seen():
    names = {name for name, _ in layers.modules()}
    assert {"ragkv.engine", "ragkv.codec.cachegen", "ragkv.cache.store", "ragkv.retriever.kv_retriever",
            "ragkv.integrations.langchain", "ragkv.model.adapter"} <= names  # fmt: skip


def test_an_upward_import_is_reported_with_its_line_lazy_or_not():
    sources = {
        "ragkv.cache.store": ("cache/store.py", "import os\n\ndef f():\n    from ragkv.engine import RagKV\n"),
        "ragkv.codec.api": ("codec/api.py", "from ragkv import retriever\n"),
        "ragkv.retriever": ("retriever/__init__.py", ""),
        "ragkv.model.adapter": ("model/adapter.py", "from ragkv.cache.config import parse_size\nimport torch\n"),
    }
    found = layers.check(sources)
    assert len(found) == 2
    assert found[0].startswith("cache/store.py:4: ragkv.cache (layer 1) imports ragkv.engine")
    assert found[1].startswith("codec/api.py:1: ragkv.codec (layer 1) imports ragkv.retriever")


def test_a_room_missing_from_the_map_is_reported():
    found = layers.check({"ragkv.newroom": ("ragkv/newroom.py", "")})
    assert found == ["ragkv/newroom.py: room ragkv.newroom is not in tools/layers.py's LAYERS"]


def test_the_architecture_page_lists_every_room_in_its_layer():
    """docs/architecture.md's table of rooms is the map in tools/layers.py, row for row."""
    import re

    rows = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines() if re.match(r"\| \d+ ", line)]
    assert len(rows) == len(layers.LAYERS), "one table row per layer"
    for level, (row, rooms) in enumerate(zip(rows, layers.LAYERS, strict=True)):
        cells = row.split("|")
        assert cells[1].strip().startswith(str(level)), row
        assert set(re.findall(r"`([\w.]+)`", cells[2])) == set(rooms), f"layer {level}: {row}"
