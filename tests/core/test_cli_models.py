"""``ragkv models`` (list, prune), ``RAGKV_MODEL``, and a CLI that leaves hub downloads to the user's settings."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ragkv import cli
from ragkv.model.conversions import ConversionKey, ModelCache


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ragkv", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> ModelCache:
    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path / "models"))
    cache = ModelCache(tmp_path / "models")
    for name, dtype in (("qwen.gguf", "bfloat16"), ("smollm2-135m", "float32")):

        def build(folder: Path) -> None:
            (folder / "config.json").write_text("{}")
            (folder / "model.safetensors").write_bytes(b"w" * 2000)

        cache.convert(ConversionKey(name.ljust(64, "0"), dtype), build, name=name, source=f"/models/{name}")
    return cache


def test_models_lists_source_dtype_size_and_last_use(monkeypatch, capsys, cache):
    code, out, _ = run(monkeypatch, capsys, "models")
    assert code == 0 and "qwen.gguf" in out and "bfloat16" in out and "smollm2-135m" in out and "float32" in out
    assert "2 converted model(s)" in out and ("ago" in out or "just now" in out)
    code, out, _ = run(monkeypatch, capsys, "models", "--json")
    rows = json.loads(out)["models"]
    assert {r["name"] for r in rows} == {"qwen.gguf", "smollm2-135m"} and all(r["size_bytes"] > 2000 for r in rows)


def test_models_prune_by_name_by_size_and_all(monkeypatch, capsys, cache):
    code, out, _ = run(monkeypatch, capsys, "models", "prune", "qwen.gguf")
    assert code == 0 and "removed 1" in out and [e.name for e in cache.entries()] == ["smollm2-135m"]
    code, _, err = run(monkeypatch, capsys, "models", "prune", "absent.gguf")
    assert code == 2 and "no converted model named 'absent.gguf'" in err and err.count("\n") == 1
    code, _, err = run(monkeypatch, capsys, "models", "prune")
    assert code == 2 and "--max-size" in err
    code, out, _ = run(monkeypatch, capsys, "models", "prune", "--all")
    assert code == 0 and cache.entries() == []


def test_ragkv_model_names_the_model_once(monkeypatch):
    from ragkv.engine import EngineConfig
    from ragkv.model.loading import DEFAULT_MODEL

    monkeypatch.delenv("RAGKV_MODEL", raising=False)
    assert EngineConfig.from_env().model == DEFAULT_MODEL
    monkeypatch.setenv("RAGKV_MODEL", "/models/qwen.gguf")
    assert EngineConfig.from_env().model == "/models/qwen.gguf"
    assert EngineConfig.from_env(model="other").model == "other"  # an option beats the variable


def test_the_cli_does_not_force_offline_mode(monkeypatch, capsys, cache):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, _, _ = run(monkeypatch, capsys, "models")
    assert code == 0 and "HF_HUB_OFFLINE" not in os.environ
