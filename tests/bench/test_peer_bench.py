"""``ragkv bench peer`` on a tiny model: the ragkv rows, the decode anatomy, and llama.cpp when installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ragkv.bench.goodput_servers import ServerStartError
from ragkv.bench.peer import (
    ANSWER,
    PeerMissingError,
    ServerPeer,
    bench_engine,
    decode_anatomy,
    format_peer_table,
    gguf_path,
    llama_run,
    load_llama,
    peer_prompts,
    run_peer_bench,
)

PROMPTS = [
    {"chunks": ["Apples grow on trees. " * 6, "Boats float on water. " * 5], "question": "Where do apples grow?"},
    {"chunks": ["Clocks measure time. " * 7], "question": "What do clocks do?"},
]


@pytest.fixture
def engine(tmp_path, llama_adapter):
    with bench_engine(llama_adapter, "model", tmp_path) as rag:
        yield rag


def test_the_prompt_ids_are_the_engines_layout(engine):
    peers = peer_prompts(engine, PROMPTS)
    r = engine.retriever
    first = peers[0]
    context = r.prefix_ids + [t for c in PROMPTS[0]["chunks"] for t in r.chunk_token_ids(c)]
    assert list(first.ids[: first.context_tokens]) == context
    suffix = engine.adapter.encode(r.layout.suffix_text(PROMPTS[0]["question"]))
    assert list(first.ids[first.context_tokens :]) == suffix


def test_ragkv_rows_without_llama_cpp(engine):
    peers = peer_prompts(engine, PROMPTS)
    systems = {"fused": ("reuse", "model"), "full": ("full", "model"), "fused int8": ("reuse", "int8")}
    rows = run_peer_bench(engine, systems, peers, llm=None, repeats=1, decode_tokens=4)
    assert [r["system"] for r in rows] == ["fused", "full", "fused int8"]
    assert engine.decode_weights == "model"  # the engine's own decode weights are back
    for row in rows:
        assert row["runs"] == 2 and row["ttft_s"] > 0 and row["decode_tok_s"] > 0
        assert row["answer_s"] == pytest.approx(row["ttft_s"] + (ANSWER - 1) / row["decode_tok_s"])
        assert "vs_llama" not in row
    assert "| fused" in format_peer_table(rows)


def test_decode_anatomy_measures_int8_against_the_model_weights(tiny_tokenizer):
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    adapter = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    rows = {r["weights"]: r for r in decode_anatomy(adapter, list(range(40, 80)), steps=6)}
    assert rows["model"]["kl_mean"] == pytest.approx(0.0, abs=1e-6) and rows["model"]["top1"] == 1.0
    assert 0 < rows["int8"]["kl_mean"] < 0.05
    for row in rows.values():
        assert row["ms_token"] > 0 and row["matmul_ms"] >= 0


def test_a_missing_llama_cpp_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if absent
    with pytest.raises(PeerMissingError, match=r"pip install 'ragkv\[peer\]'"):
        load_llama(tmp_path / "m.gguf", threads=1, n_ctx=64)


def test_only_a_gguf_file_can_be_compared(tmp_path):
    assert gguf_path("smollm2-135m").suffix == ".gguf"
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        gguf_path(str(tmp_path / "model.bin"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python (ragkv[peer])")
def test_llama_cpp_answers_the_same_prompt_ids_cold_and_warm():
    from ragkv.bench.peer import PeerPrompt
    from ragkv.model import load_model

    adapter = load_model("smollm2-135m")
    ids = adapter.encode("<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n")
    prompt = PeerPrompt((), "", tuple(ids), len(ids) - 3)
    llm = load_llama(gguf_path("smollm2-135m"), threads=1, n_ctx=256)
    cold, warm = llama_run(llm, prompt, 8, warm=False), llama_run(llm, prompt, 8, warm=True)
    assert cold.tokens == warm.tokens == 8 and cold.ttft_s > 0 and warm.ttft_s > 0


def test_busy_processes_run_for_the_block_and_are_gone_after(monkeypatch):
    import subprocess

    from ragkv.bench import peer

    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(peer.subprocess, "Popen", Recorded)
    with peer.busy_processes(2):
        assert len(started) == 2 and all(p.poll() is None for p in started)  # spinning
    assert all(p.poll() is not None for p in started)  # killed and reaped


def _stand_in(tmp_path, *extra: str):
    """An executable running the stand-in llama-server (tests/bench/fake_llama_server.py) with ``extra`` flags."""
    fake = Path(__file__).with_name("fake_llama_server.py")
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@" {" ".join(extra)}\n')
    script.chmod(0o755)
    return script


def test_llama_server_as_the_peer_gets_the_prompt_ids_cold_and_warm(engine, tmp_path):
    """The stand-in server records what it is asked: cold, the whole prompt computed (no prompt cache); warm,
    the context first (nothing generated, kept in the slot), then the prompt; greedy, end token ignored."""
    record = tmp_path / "asked.jsonl"
    prompt = peer_prompts(engine, PROMPTS)[0]
    with ServerPeer(_stand_in(tmp_path, "--record", str(record)), tmp_path / "m.gguf", 2, 512, tmp_path / "log") as p:
        cold, warm = p.run(prompt, 5, warm=False), p.run(prompt, 5, warm=True)
        assert p.server.proc.poll() is None
    assert p.server.proc.poll() is not None  # stopped on leaving
    assert cold.tokens == warm.tokens == 5 and cold.ttft_s > 0 and cold.decode_s >= 0
    asked = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(a["path"], a["n_predict"], a["cache_prompt"]) for a in asked] == [
        ("/completion", 6, False),
        ("/completion", 0, True),
        ("/completion", 6, True),
    ]
    assert asked[0]["prompt"] == asked[2]["prompt"] == list(prompt.ids)
    assert asked[1]["prompt"] == list(prompt.ids[: prompt.context_tokens])
    assert all(a["temperature"] == 0 and a["ignore_eos"] and a["stream"] for a in asked)


def test_a_llama_server_that_cannot_start_says_why(tmp_path):
    with pytest.raises(ServerStartError, match="fake llama-server failed to load the model"):
        ServerPeer(_stand_in(tmp_path, "--fail"), tmp_path / "m.gguf", 2, 512, tmp_path / "log", start_s=30)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_bench_peer_without_llama_cpp_says_what_to_build_or_runs_ragkv_alone(monkeypatch, tmp_path, capsys):
    import typer

    from ragkv.cli.bench import _peer

    monkeypatch.setenv("RAGKV_LLAMA_SERVER", str(tmp_path / "nothing-here"))
    with pytest.raises(typer.BadParameter, match="tools/build_llama_server.sh"):
        _peer("server", None, tmp_path / "m.gguf", 2, 512, tmp_path)
    with pytest.raises(typer.BadParameter, match="pip install 'ragkv\\[peer\\]'"):
        _peer("library", None, tmp_path / "m.gguf", 2, 512, tmp_path)
    assert _peer("auto", None, tmp_path / "m.gguf", 2, 512, tmp_path) is None
    assert "running the ragkv rows alone" in capsys.readouterr().err
    with pytest.raises(typer.BadParameter, match="auto, library or server"):
        _peer("vllm", None, tmp_path / "m.gguf", 2, 512, tmp_path)
    peer = _peer("auto", str(_stand_in(tmp_path)), tmp_path / "m.gguf", 2, 512, tmp_path)
    try:
        assert isinstance(peer, ServerPeer) and peer.name.startswith("llama-server")
    finally:
        peer.close()
