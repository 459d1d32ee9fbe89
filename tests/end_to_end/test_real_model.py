"""Integration tests on the real default model (SmolLM2-135M-Instruct from its PyPI package)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse

pytestmark = pytest.mark.slow

CHUNKS = [
    "The heapq module provides an implementation of the heap queue algorithm, also known as the "
    "priority queue algorithm. heappush(heap, item) pushes the value item onto the heap, "
    "maintaining the heap invariant.",
    "The bisect module provides support for maintaining a list in sorted order without having to "
    "sort the list after each insertion. bisect_left(a, x) locates the insertion point for x.",
]


def test_default_model_loads_offline_and_is_llama(real_adapter):
    assert real_adapter.spec.model_type == "llama" and real_adapter.spec.num_layers == 30
    assert real_adapter.spec.num_kv_heads == 3 and real_adapter.spec.head_dim == 64


def test_full_fusion_matches_full_prefill_on_the_real_model(real_adapter):
    a = real_adapter
    prefix, chunks, suffix = a.chat_segments(None, CHUNKS, "What does heappush do?")
    pre = a.prefill_kv(prefix)
    cached = [a.prefill_kv(c, past=[pre]) for c in chunks]
    fused = fuse(a, FusionInput(pre, cached, chunks, suffix), FusionConfig(method="full"))
    got = a.forward(suffix, fused.cache, fused.num_tokens)
    ref = a.forward(prefix + sum(chunks, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)

    # naive reuse differs; blending at 30% is closer to full than naive
    def kl(method, ratio):
        f = fuse(a, FusionInput(pre, cached, chunks, suffix), FusionConfig(method=method, ratio=ratio))
        lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(a.forward(suffix, f.cache, f.num_tokens), -1)
        return float((lp.exp() * (lp - lq)).sum(-1).mean())

    assert kl("blend", 0.3) < kl("naive", 0.0)


def test_cli_index_then_ask_json_in_separate_processes(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(CHUNKS):
        (docs / f"d{i}.txt").write_text(text * 3)
    env = {**os.environ, "RAGKV_DATA_DIR": str(tmp_path / "data")}
    cli = [sys.executable, "-m", "ragkv.cli"]
    out = subprocess.run([*cli, "index", str(docs)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [*cli, "ask", "--json", "--max-new-tokens", "16", "What does heappush do?"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(data) == {"answer", "sources", "stats"} and data["answer"]
    stats = data["stats"]
    for key in (
        "ttft_ms",
        "prompt_tokens",
        "reused_tokens",
        "recomputed_tokens",
        "prefilled_chunk_tokens",
        "bytes_loaded",
    ):
        assert key in stats
    assert stats["prefilled_chunk_tokens"] == 0 and stats["bytes_loaded"] > 0
    bad = subprocess.run([*cli, "ask", "x" * 40000], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "context" in bad.stderr


def test_cli_help_works():
    out = subprocess.run([sys.executable, "-m", "ragkv.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "index" in out.stdout and "demo" in out.stdout


def test_first_load_converts_the_gguf_into_a_complete_model(tmp_path, monkeypatch, real_adapter):
    """A fresh machine's first load converts the GGUF file in-process: the model it returns must be
    whole (no meta tensors: a meta build once left RoPE buffers empty) and equal to later loads."""
    from ragkv.model import load_model

    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path / "models"))
    fresh = load_model("smollm2-135m")
    assert not [n for n, b in fresh.model.named_buffers() if b.is_meta]
    assert not [n for n, p in fresh.model.named_parameters() if p.is_meta]
    assert fresh.fingerprint == real_adapter.fingerprint
    assert (tmp_path / "models").is_dir()
    ids = fresh.encode("The heap queue algorithm.")
    torch.testing.assert_close(fresh.prefill_kv(ids).keys, real_adapter.prefill_kv(ids).keys)
