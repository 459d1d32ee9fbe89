"""The conversion cache and the header check: convert once per (content, dtype, converter), refuse before paying."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ragkv.errors import UnsupportedModelError
from ragkv.model import loading
from ragkv.model.conversions import CONVERTER_VERSION, ConversionKey, ModelCache
from ragkv.model.gguf_header import GGUF_FAMILIES, check_gguf, read_architecture


def _fake_build(calls: list[str], delay_s: float = 0.0):
    """A stand-in conversion: writes a config and a weights file, records that it ran."""

    def build(folder: Path) -> None:
        calls.append(folder.name)
        time.sleep(delay_s)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"w" * 1000)

    return build


def _key(dtype: str = "float32", source: str = "a" * 64) -> ConversionKey:
    return ConversionKey(source_digest=source, dtype=dtype)


# ---- the cache --------------------------------------------------------------------------------------
def test_an_entry_is_found_only_for_its_own_key(tmp_path):
    cache, calls = ModelCache(tmp_path), []
    entry = cache.convert(_key("float32"), _fake_build(calls), name="m.gguf", source="/x/m.gguf")
    assert cache.lookup(_key("float32")) == entry and len(calls) == 1
    # the bug this fixes: a bf16 conversion served where fp32 was asked (and Ray workers disagreeing)
    assert cache.lookup(_key("bfloat16")) is None
    assert cache.lookup(_key(source="b" * 64)) is None
    assert cache.lookup(ConversionKey(source_digest="a" * 64, dtype="float32", converter=CONVERTER_VERSION + 1)) is None
    other = cache.convert(_key("bfloat16"), _fake_build(calls), name="m.gguf", source="/x/m.gguf")
    assert other != entry and {e.dtype for e in cache.entries()} == {"float32", "bfloat16"}


def test_a_manifest_that_does_not_match_is_converted_again(tmp_path):
    cache, calls = ModelCache(tmp_path), []
    entry = cache.convert(_key(), _fake_build(calls), name="m", source="/m")
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["key"]["dtype"] = "bfloat16"  # tampered, or written by another version under the same name
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert cache.lookup(_key()) is None
    again = cache.convert(_key(), _fake_build(calls), name="m", source="/m")
    assert len(calls) == 2 and cache.lookup(_key()) == again


def test_a_failed_conversion_leaves_nothing_half_written(tmp_path):
    cache = ModelCache(tmp_path)

    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError):
        cache.convert(_key(), broken, name="m", source="/m")
    assert cache.entries() == [] and cache.lookup(_key()) is None
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
    assert not list(tmp_path.glob(".tmp-*"))


def test_two_concurrent_first_loads_convert_once_and_leave_one_good_entry(tmp_path):
    calls: list[str] = []
    results: list[Path] = []

    def load() -> None:  # each thread its own ModelCache, as two processes would have
        results.append(ModelCache(tmp_path).convert(_key(), _fake_build(calls, 0.3), name="m", source="/m"))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert len(ModelCache(tmp_path).entries()) == 1


def test_prune_by_name_and_down_to_a_size(tmp_path):
    cache, calls = ModelCache(tmp_path), []
    a = cache.convert(_key(source="a" * 64), _fake_build(calls), name="a.gguf", source="/x/a.gguf")
    cache.convert(_key(source="b" * 64), _fake_build(calls), name="b.gguf", source="/x/b.gguf")
    cache.convert(_key(source="c" * 64), _fake_build(calls), name="c.gguf", source="/x/c.gguf")
    os.utime(a / "last_used", (time.time() + 10, time.time() + 10))  # a is the most recently used
    assert [e.name for e in cache.prune(name="b.gguf")] == ["b.gguf"]
    size = cache.entries()[0].size_bytes
    removed = cache.prune(max_bytes=size)  # room for one: the least recently used (c) goes
    assert [e.name for e in removed] == ["c.gguf"] and [e.name for e in cache.entries()] == ["a.gguf"]
    with pytest.raises(ValueError, match="say what to prune"):
        cache.prune()


def test_a_size_cap_is_enforced_on_every_conversion_but_keeps_the_new_entry(tmp_path):
    calls: list[str] = []
    cache = ModelCache(tmp_path, max_bytes=10)  # smaller than any entry
    cache.convert(_key(source="a" * 64), _fake_build(calls), name="a", source="/a")
    new = cache.convert(_key(source="b" * 64), _fake_build(calls), name="b", source="/b")
    assert [e.path for e in cache.entries()] == [new]


def test_file_digests_are_memoized_until_the_file_changes(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    cache = ModelCache(tmp_path / "cache")
    first = cache.file_digest(f)
    opened: list[str] = []
    real_open = Path.open

    def counting_open(self, *a, **k):
        if self == f.resolve():
            opened.append("open")
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", counting_open)
    assert cache.file_digest(f) == first and opened == []  # memo hit: not hashed again
    f.write_bytes(b"two!")
    opened.clear()
    assert cache.file_digest(f) != first and opened == ["open"]


# ---- the header check ---------------------------------------------------------------------------------
def _gguf(path: Path, arch: str, truncate_after_header: bool = False) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_token_list([b"a", b"b"])  # an array value before the tensors: skipped, not parsed
    w.add_tensor("token_embd.weight", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate_after_header:  # keep the key/value section, drop most of the tensor data
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 64 * 64 * 4 + 16])
    return path


def test_the_architecture_is_read_from_the_header_alone(tmp_path):
    path = _gguf(tmp_path / "q.gguf", "qwen2", truncate_after_header=True)
    assert read_architecture(path) == "qwen2" and check_gguf(path) == "qwen2"


def test_tensor_types_and_weight_bits_come_from_the_header(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    from ragkv.model.gguf_header import read_tensor_types, weight_bits

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_token_list([f"t{i}".encode() for i in range(1000)])  # a vocabulary: skipped by lengths
    w.add_tensor("token_embd.weight", np.ones((8, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.ones((8, 64), dtype=np.float16))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 68), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    types = read_tensor_types(path)
    assert types == {
        "token_embd.weight": ("F32", (64, 8)),
        "blk.0.attn_q.weight": ("F16", (64, 8)),
        "blk.0.ffn_up.weight": ("Q8_0", (64, 8)),
    }
    assert weight_bits(path) == 16  # the widest decoder matrix
    data = path.read_bytes()
    path.write_bytes(data[:100])  # cut inside the vocabulary
    with pytest.raises(ValueError, match="truncated"):
        read_tensor_types(path)


def test_an_unsupported_architecture_is_refused_without_reading_tensor_data(tmp_path, monkeypatch):
    path = _gguf(tmp_path / "gemma-3-270m.gguf", "gemma3", truncate_after_header=True)
    converted: list[str] = []
    monkeypatch.setattr(loading, "_convert_gguf", lambda *a: converted.append("converted"))
    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedModelError) as e:
        loading.resolve(str(path))
    message = str(e.value)
    assert "'gemma3'" in message and "gemma-3-270m.gguf" in message and all(f in message for f in GGUF_FAMILIES)
    assert converted == [] and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"PK\x03\x04 a zip file", "not a GGUF file"), (b"GGUF\x03\x00", "truncated"), (b"", "not a GGUF file")],
)
def test_a_file_that_is_not_a_whole_gguf_header_is_a_clear_error(tmp_path, content, match):
    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        loading.resolve(str(f))
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_a_folder_whose_config_names_an_unsupported_family_is_refused_before_weights(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("cohere", logit_scale=0.25).save_pretrained(tmp_path)  # config.json only, no weights
    with pytest.raises(UnsupportedModelError, match="logit_scale"):
        loading.resolve(str(tmp_path))


# ---- the real default model: converted once per session, then loaded from the entry -------------------
@pytest.mark.slow
def test_a_second_load_reads_the_entry_and_another_dtype_converts_anew(real_adapter, monkeypatch, tmp_path):
    import shutil

    # a cache holding only the session's fp32 entry (other tests may have added bf16/fp16 ones)
    session = loading.model_cache()
    # by its source file: a run that named the file instead of the alias (ragkv bench goodput's
    # server) renames the same entry
    from ragkv.bench.peer import gguf_path

    source = gguf_path("smollm2-135m").resolve()
    (fp32,) = [e for e in session.entries() if Path(e.source).resolve() == source and e.dtype == "float32"]
    shutil.copytree(fp32.path, tmp_path / fp32.path.relative_to(session.root))
    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path))

    def must_not_convert(*a):
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "_convert_gguf", must_not_convert)
    model, _, _ = loading.resolve("smollm2-135m", dtype="float32")
    assert next(model.parameters()).dtype == torch.float32
    entries = loading.model_cache().entries()
    # the entry is the session's own (whichever name first converted it: the alias or the file name)
    assert [e.dtype for e in entries] == ["float32"] and Path(entries[0].source).resolve() == source
    # the folder other engines (vLLM) load: that same entry, not converted again
    assert loading.converted_folder("smollm2-135m", "float32") == entries[0].path
    with pytest.raises(AssertionError, match="converted again"):  # bf16 is its own entry, never the fp32 one
        loading.resolve("smollm2-135m", dtype="bfloat16")


def test_a_converted_folder_is_asked_of_gguf_models_only(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF model"):
        loading.converted_folder(str(tmp_path))


def test_tests_never_see_the_users_caches():
    home = str(Path.home() / ".cache")
    for var in ("RAGKV_MODEL_CACHE", "HF_HOME", "RAGKV_DATA_DIR"):
        assert not os.environ[var].startswith(home), var
    assert not str(loading.model_cache_dir()).startswith(home)
