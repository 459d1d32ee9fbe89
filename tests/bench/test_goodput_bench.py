"""``ragkv bench goodput``: the trace, the report's arithmetic, finding llama-server, one run against ragkv serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ragkv.bench import goodput_servers as gs
from ragkv.bench.goodput import (
    GoodputConfig,
    RequestResult,
    format_goodput,
    highest_sustained,
    plot_goodput,
    poisson_arrivals,
    rate_row,
    run_goodput,
    same_answers,
    summarize,
)
from ragkv.bench.goodput_trace import (
    TraceRequest,
    build_trace,
    check_context,
    load_trace,
    save_trace,
    zipf_weights,
)

FAKE_PEER = Path(__file__).with_name("fake_llama_server.py")
CORPUS = [
    f"Chunk {i} describes the harbour of town number {i}. Its fishermen bring in mackerel every single morning "
    f"while the merchants of district {i} count their silver coins beside the old lighthouse tower."
    for i in range(60)
]


def _fake_peer(tmp_path: Path, *extra: str) -> Path:
    """An executable that runs the stand-in llama-server with the flags it is given (and ``extra``)."""
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_PEER} "$@" {" ".join(extra)}\n')
    script.chmod(0o755)
    return script


# --- the trace ---


def test_every_request_has_3_to_5_distinct_chunks_in_the_order_drawn():
    trace = build_trace(CORPUS, 40, seed=1)
    assert {len(r.chunks) for r in trace} == {3, 4, 5}
    for r in trace:
        assert len(set(r.chunk_ids)) == len(r.chunk_ids)
        assert r.chunks == tuple(CORPUS[i] for i in r.chunk_ids)
        positions = [r.prompt.index(c + "\n\n") for c in r.chunks]  # each chunk then ragkv's separator
        assert positions == sorted(positions)
        assert r.prompt.rstrip().endswith("Answer:") and r.question in r.prompt


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    assert build_trace(CORPUS, 20, seed=7) == build_trace(CORPUS, 20, seed=7)
    assert build_trace(CORPUS, 20, seed=7) != build_trace(CORPUS, 20, seed=8)


def test_zipf_skew_makes_a_few_chunks_recur():
    def top_share(skew: float) -> float:
        trace = build_trace(CORPUS, 100, skew=skew, seed=3)
        counts = Counter(i for r in trace for i in r.chunk_ids)
        return counts.most_common(1)[0][1] / len(trace)

    assert top_share(2.0) > 0.8  # the rank-1 chunk is in almost every prompt
    assert top_share(0.0) < 0.3  # uniform: about 4/60 of prompts each
    assert zipf_weights(3, 1.0) == [1.0, 0.5, 1 / 3]
    with pytest.raises(ValueError, match="skew"):
        zipf_weights(3, -1.0)


def test_questions_are_clozes_on_the_first_chunk():
    trace = build_trace(CORPUS, 5, seed=0)
    assert all("____" in r.question and "first document" in r.question for r in trace)


def test_a_prompt_longer_than_the_context_is_refused_naming_its_line():
    trace = [TraceRequest(("a b c",), "q"), TraceRequest(("a " * 500,), "q")]
    words = lambda text: len(text.split())  # noqa: E731
    assert check_context(trace[:1], words, 100, 10, "t.jsonl") == words(trace[0].prompt)
    with pytest.raises(ValueError, match=r"t\.jsonl:2: the prompt has \d+ tokens; with --max-tokens 10"):
        check_context(trace, words, 100, 10, "t.jsonl")


def test_a_trace_file_round_trips_and_a_bad_line_is_named(tmp_path):
    trace = build_trace(CORPUS, 4, seed=0)
    save_trace(trace, tmp_path / "t.jsonl")
    loaded = load_trace(tmp_path / "t.jsonl")
    assert [(r.chunks, r.question) for r in loaded] == [(r.chunks, r.question) for r in trace]
    (tmp_path / "bad.jsonl").write_text('{"chunks": ["x"], "question": "q"}\n{"chunks": [], "question": "q"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'chunks'"):
        load_trace(tmp_path / "bad.jsonl")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not JSON"):
        load_trace(tmp_path / "bad.jsonl")


# --- the report's arithmetic ---


def _result(i: int, ttft: float, text: str = "x", error: str | None = None, tokens: int = 4) -> RequestResult:
    return RequestResult(i, sent=i, ttft=ttft, latency=ttft + 1, tokens=tokens, gaps=[0.1, 0.3], text=text,
                         error=error, cached=100)  # fmt: skip


def test_rate_row_counts_goodput_within_the_slo_over_the_span():
    results = [_result(0, 0.5), _result(1, 1.0), _result(2, 3.0), _result(3, 0.2, error="HTTP 500")]
    row = rate_row("ragkv", 0.1, results, span_s=10.0, slo_s=1.0)
    assert row["requests"] == 4 and row["completed"] == 3
    assert row["ttft_p50"] == 1000 and row["ttft_p95"] == 3000  # nearest rank over the completed
    assert row["gap_p95"] == 300
    assert row["goodput"] == pytest.approx(0.2)  # 2 within 1 s (the failed one never counts) over 10 s
    assert row["attained"] == 0.5 and row["tok_s"] == pytest.approx(1.2) and row["cached"] == 100


def test_highest_sustained_rate_stops_at_the_first_rate_that_misses():
    rows = [{"server": "a", "rate": r, "attained": at} for r, at in ((0.1, 1.0), (0.2, 0.95), (0.4, 0.5), (0.8, 0.9))]
    assert highest_sustained(rows, "a", 0.9) == 0.2  # 0.8 passing after 0.4 failed is noise, not capacity
    assert highest_sustained(rows, "a", 0.99) == 0.1
    assert highest_sustained([{"server": "a", "rate": 0.1, "attained": 0.0}], "a") is None


def test_summary_ratios_and_identical_answers():
    rows = [
        {"server": "ragkv", "rate": 0.1, "attained": 1.0, "ttft_p95": 500.0, "tok_s": 9.0},
        {"server": "llama-server", "rate": 0.1, "attained": 1.0, "ttft_p95": 2000.0, "tok_s": 10.0},
        {"server": "llama-server", "rate": 0.2, "attained": 0.0, "ttft_p95": 9000.0, "tok_s": 10.0},
    ]
    summary = summarize(rows, ["ragkv", "llama-server"], 0.9)
    assert summary["sustained_ragkv"] == 0.1 and summary["sustained_llama-server"] == 0.1
    assert summary["ttft_p95_ratio"] == 0.25 and summary["tok_s_ratio"] == 0.9
    a = [_result(0, 1, "Paris "), _result(1, 1, "x"), _result(2, 1, "y", error="boom")]
    b = [_result(0, 1, " Paris"), _result(1, 1, "z"), _result(2, 1, "y")]
    assert same_answers(a, b) == (1, 2)


def test_poisson_arrivals_are_seeded_and_average_one_over_the_rate():
    times = poisson_arrivals(2000, 0.5, seed=4)
    assert times == poisson_arrivals(2000, 0.5, seed=4) and times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / (len(times) - 1) == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0, seed=0)


# --- finding and starting llama-server ---


def test_a_missing_llama_server_names_the_build_script(tmp_path, monkeypatch):
    monkeypatch.delenv("RAGKV_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(gs, "DEFAULT_BUILD", tmp_path / "nothing")
    with pytest.raises(gs.LlamaServerMissingError, match="tools/build_llama_server.sh"):
        gs.find_llama_server()
    with pytest.raises(gs.LlamaServerMissingError, match=r"--llama-server names .*not an executable"):
        gs.find_llama_server(str(tmp_path / "absent"))
    monkeypatch.setenv("RAGKV_LLAMA_SERVER", str(_fake_peer(tmp_path)))
    assert gs.find_llama_server() == tmp_path / "llama-server"


def test_the_cli_says_how_to_build_a_missing_llama_server(tmp_path):
    env = {**os.environ, "RAGKV_LLAMA_SERVER": str(tmp_path / "absent")}
    out = subprocess.run([sys.executable, "-m", "ragkv.cli", "bench", "goodput"], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "bash tools/build_llama_server.sh" in out.stderr and "RAGKV_LLAMA_SERVER" in out.stderr


def test_a_server_that_fails_to_start_is_reported_with_its_log(tmp_path):
    spec = gs.llama_server_spec(_fake_peer(tmp_path, "--fail"), tmp_path / "m.gguf", 1, 512, 1)
    with gs.ServerProcess(spec, tmp_path / "peer.log") as server, pytest.raises(gs.ServerStartError) as e:
        gs.wait_all_ready([server], timeout_s=60)
    assert "exited with status 3" in str(e.value) and "fake llama-server failed to load the model" in str(e.value)


def test_when_the_peer_fails_ragkv_is_not_timed_alone(tmp_path):
    """run_goodput stops at the first failed start: no rows, the peer's log in the error."""
    cfg = GoodputConfig(tmp_path / "m.gguf", _fake_peer(tmp_path, "--fail"), (1.0,), requests=1)
    with pytest.raises(gs.ServerStartError, match="fake llama-server failed"):
        run_goodput(cfg, build_trace(CORPUS, 1), tmp_path)


# --- one run against ragkv serve ---


@pytest.mark.slow
def test_one_run_against_ragkv_serve_on_the_default_model(tmp_path):
    """The real default model behind ragkv serve; the stand-in peer, or the llama-server that
    ``RAGKV_LLAMA_SERVER`` names (opt-in: a build found in the user's cache is not used, so the
    suite's time and behaviour do not depend on what a machine happens to hold)."""
    from ragkv.bench.peer import gguf_path

    named = os.environ.get("RAGKV_LLAMA_SERVER")
    binary, real = (gs.find_llama_server(named), True) if named else (_fake_peer(tmp_path), False)
    trace = build_trace(CORPUS[:12], 4, seed=0)
    cfg = GoodputConfig(gguf_path("smollm2-135m"), binary, (0.5, 1.0), requests=2, max_tokens=4, threads=2,
                        context=2048, parallel=2)  # fmt: skip
    rows, summary = run_goodput(cfg, trace, tmp_path)
    assert [(r["server"], r["rate"]) for r in rows] == [
        ("ragkv", 0.5), ("ragkv", 1.0), ("llama-server", 0.5), ("llama-server", 1.0)
    ]  # fmt: skip
    assert all(r["completed"] == 2 and r["ttft_p95"] >= r["ttft_p50"] > 0 and r["tok_s"] > 0 for r in rows)
    assert all(r["cached"] > 0 for r in rows if r["server"] == "ragkv")  # its matcher found the indexed chunks
    assert summary["slo_ms"] > 0 and "cache off" in summary["slo_source"]
    assert summary["same_answers"][1] == 4 and (real or summary["same_answers"][0] == 0)
    assert "--cache-reuse 256" in summary["llama_server_settings"] and "dtype" in summary["machine"]
    text = format_goodput(rows, summary)
    assert "highest rate sustained within the SLO" in text and "greedy answers identical" in text
    plot_goodput(rows, summary["slo_ms"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    json.dumps([*rows, {"summary": summary}])  # the --json rows serialize
