"""``ragkv bench peer``: ragkv against llama.cpp on the same GGUF and prompt token ids.

llama.cpp runs through its Python binding (llama-cpp-python, ``ragkv[peer]``) or, where that is not
installed, as ``llama-server`` (built by ``tools/build_llama_server.sh``) with one slot, asked for
each answer over loopback HTTP (:class:`ServerPeer`); the table says which.

What a ragkv user would run instead is llama.cpp on the same file. Both sides get the same prompt
token ids (ragkv's tokenizer, ragkv's RAG layout); runs are interleaved (each prompt runs every
system in turn, repeated), and each figure is a median. llama.cpp runs with ``OMP_WAIT_POLICY=PASSIVE``
(its OpenMP threads would otherwise spin and steal the cores ragkv needs between its own runs)
and the same thread count as torch.

Per system: TTFT (prompt in to first token out), decode tokens/s (the tokens after the first),
and the time to a 128-token answer, ``TTFT + 127 / decode rate``, so an early end token on one
side does not shorten its answer. ragkv rows run through the engine (chunk caches in its memory
tier, decoded by its codec); the llama.cpp warm row has the prompt's prefix and chunks already
in its KV cache (what llama.cpp reuses when the same documents come back in the same order).
"""

from __future__ import annotations

import importlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ragkv.bench.table import Column, format_table
from ragkv.model.native import PROFILED_NAME

__all__ = [
    "INSTALL_HINT",
    "LibraryPeer",
    "Peer",
    "PeerMissingError",
    "PeerPrompt",
    "ServerPeer",
    "bench_engine",
    "decode_anatomy",
    "format_peer_table",
    "gguf_path",
    "load_llama",
    "peer_prompts",
    "run_peer_bench",
]

INSTALL_HINT = (
    "llama.cpp's Python binding is not installed; install it with  pip install 'ragkv[peer]'  "
    '(a C++ build of several minutes; CMAKE_ARGS="-DGGML_NATIVE=ON" builds kernels for this CPU)'
)
ANSWER = 128  # the answer length the table's time is for

COLUMNS = (
    Column("system"),
    Column("ttft_s", "TTFT s", "{:.2f}"),
    Column("decode_tok_s", "decode tok/s", "{:.1f}"),
    Column("answer_s", f"{ANSWER}-token answer s", "{:.1f}"),
    Column("vs_llama", "vs llama.cpp full", "{:.2f}x"),
    Column("runs"),
)


class PeerMissingError(RuntimeError):
    """llama-cpp-python is not installed (the message says how to install it)."""


@dataclass(frozen=True, slots=True)
class PeerPrompt:
    """One RAG prompt as both sides see it."""

    chunks: tuple[str, ...]  # chunk texts (ragkv loads or computes their caches)
    question: str
    ids: tuple[int, ...]  # the whole prompt's token ids: prefix, chunks, suffix
    context_tokens: int  # tokens of prefix + chunks (llama.cpp's warm prefix)


@dataclass(frozen=True, slots=True)
class Run:
    """One answer's timing."""

    ttft_s: float
    decode_s: float  # first token out to last token out
    tokens: int  # tokens after the first

    @property
    def per_token_s(self) -> float:
        return self.decode_s / self.tokens if self.tokens else float("nan")


def load_llama(gguf: Path, threads: int, n_ctx: int) -> Any:
    """A llama.cpp model on ``gguf`` with ``threads`` threads (passive OpenMP waits); raises PeerMissingError."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when llama.cpp's OpenMP runtime starts
    try:
        llama_cpp = importlib.import_module("llama_cpp")  # an optional extra: no stubs for mypy to find
    except ImportError as e:
        raise PeerMissingError(INSTALL_HINT) from e
    return llama_cpp.Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )


def llama_run(llm: Any, prompt: PeerPrompt, decode_tokens: int, warm: bool) -> Run:
    """Greedy-decode ``decode_tokens`` + 1 tokens of ``prompt`` with llama.cpp (from scratch, or a warm prefix)."""
    llm.reset()
    ids = list(prompt.ids)
    if warm:
        llm.eval(ids[: prompt.context_tokens])  # generate() below finds this prefix and evaluates the rest
    t0 = time.perf_counter()
    first = 0.0
    n = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        n += 1
        if n == 1:
            first = time.perf_counter()
        if n > decode_tokens:
            break
    end = time.perf_counter()
    return Run(first - t0, end - first, n - 1)


class Peer(Protocol):
    """llama.cpp, however it runs: one greedy answer of a prompt, timed."""

    name: str  # what runs it, for the table's footer

    def run(self, prompt: PeerPrompt, decode_tokens: int, warm: bool) -> Run:
        """Greedy-decode ``decode_tokens`` + 1 tokens of ``prompt`` (from scratch, or with its context cached)."""
        ...


class LibraryPeer:
    """llama.cpp through llama-cpp-python (:func:`load_llama`)."""

    name = "llama-cpp-python"

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def run(self, prompt: PeerPrompt, decode_tokens: int, warm: bool) -> Run:
        return llama_run(self.llm, prompt, decode_tokens, warm)


class ServerPeer:
    """llama.cpp as ``llama-server`` (one slot, the same threads), asked over loopback HTTP.

    Each answer is one streamed ``POST /completion`` of the prompt's token ids (greedy, the end
    token ignored, as the binding's loop does), timed at the client as the binding's rows are:
    request sent to first token, then the rest. From scratch: ``cache_prompt`` false, so the slot
    computes the whole prompt. Warm: the context (prefix and chunks) is sent first with
    ``n_predict`` 0 and ``cache_prompt`` true, so the timed request finds it in the slot's cache.
    A context manager: leaving it stops the server.

    Raises:
        ServerStartError: the server exited or did not answer ``/health`` within ``start_s``
            (with its command and the last lines of its log).
    """

    def __init__(self, binary: Path, gguf: Path, threads: int, n_ctx: int, log: Path, start_s: float = 180.0) -> None:
        from ragkv.bench.goodput_servers import ServerProcess, llama_server_spec, wait_all_ready

        self.name = f"llama-server ({binary})"
        self.server = ServerProcess(llama_server_spec(binary, gguf, threads, n_ctx, parallel=1), log)
        try:
            wait_all_ready([self.server], start_s)
        except BaseException:
            self.server.stop()
            raise

    def _complete(self, ids: Sequence[int], n_predict: int, cache_prompt: bool) -> tuple[float, float, int]:
        """(seconds to the first token, seconds after it, tokens after it) of one streamed completion."""
        import json

        import httpx

        body = {"prompt": list(ids), "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "repeat_penalty": 1.0, "ignore_eos": True, "cache_prompt": cache_prompt, "stream": True}  # fmt: skip
        t0 = time.perf_counter()
        first, n = 0.0, 0
        with httpx.stream("POST", f"{self.server.spec.url}/completion", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("content") or event.get("tokens"):
                    n += 1
                    if n == 1:
                        first = time.perf_counter()
                if event.get("stop"):  # the last event counts every token (text held back included)
                    n = int(event.get("tokens_predicted") or n)
                    break
        end = time.perf_counter()
        return (first or end) - t0, end - (first or end), max(0, n - 1)

    def run(self, prompt: PeerPrompt, decode_tokens: int, warm: bool) -> Run:
        if warm:
            self._complete(prompt.ids[: prompt.context_tokens], 0, cache_prompt=True)
        return Run(*self._complete(prompt.ids, decode_tokens + 1, cache_prompt=warm))

    def close(self) -> None:
        """Stop the server."""
        self.server.stop()

    def __enter__(self) -> ServerPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ragkv_run(engine: Any, prompt: PeerPrompt, mode: str, decode_tokens: int, weights: str | None = None) -> Run:
    """One engine answer (``mode`` reuse or full) of at most ``decode_tokens`` + 1 tokens.

    ``weights``: decode weights to answer with instead of the engine's own (another format on the
    same engine, so every format reuses the same stored chunk caches).
    """
    from ragkv.generation import GenerationConfig

    stats = None
    gen = GenerationConfig(max_new_tokens=decode_tokens + 1, ignore_eos=True)  # as llama.cpp's loop
    own = engine.decode_weights
    engine.decode_weights = weights or own
    try:
        for _, s in engine.generate_stream(list(prompt.chunks), prompt.question, mode=mode, generation=gen):
            stats = s if s is not None else stats
    finally:
        engine.decode_weights = own
    if stats is None:  # pragma: no cover - the stream always ends with its stats
        raise RuntimeError("the answer stream ended without stats")
    return Run(stats.ttft_ms / 1000, (stats.total_ms - stats.ttft_ms) / 1000, max(0, stats.generated_tokens - 1))


def peer_prompts(engine: Any, prompts: Sequence[dict[str, Any]]) -> list[PeerPrompt]:
    """The prompts as the engine lays them out (prefix, chunks, suffix), with their token ids."""
    r = engine.retriever
    out = []
    for p in prompts:
        context = r.prefix_ids + [t for c in p["chunks"] for t in r.chunk_token_ids(c)]
        suffix = engine.adapter.encode(r.layout.suffix_text(p["question"]))
        out.append(PeerPrompt(tuple(p["chunks"]), p["question"], tuple(context + suffix), len(context)))
    return out


def _summary(system: str, runs: Sequence[Run]) -> dict[str, Any]:
    ttft = statistics.median(r.ttft_s for r in runs)
    per_token = statistics.median(r.per_token_s for r in runs if r.tokens)
    return {
        "system": system,
        "ttft_s": ttft,
        "decode_tok_s": 1 / per_token,
        "answer_s": ttft + (ANSWER - 1) * per_token,
        "runs": len(runs),
    }


def run_peer_bench(
    engine: Any,
    systems_wanted: dict[str, tuple[str, str]],
    prompts: Sequence[PeerPrompt],
    *,
    llm: Peer | None,
    repeats: int = 3,
    decode_tokens: int = 32,
    on_run: Callable[[str, Run], None] | None = None,
) -> list[dict[str, Any]]:
    """Interleaved runs of every system on every prompt, ``repeats`` times; one median row per system.

    Args:
        engine: the ragkv engine (its store keeps the chunk caches every ragkv row reuses).
        systems_wanted: row name -> (mode, decode weights) for the ragkv rows (mode ``reuse`` or
            ``full``; weights ``model``, ``int8`` or ``int4``).
        prompts: the prompts (see :func:`peer_prompts`).
        llm: llama.cpp (:class:`LibraryPeer` or :class:`ServerPeer`), or None to run ragkv alone.
        repeats: rounds over all prompts.
        decode_tokens: tokens decoded after the first per run (the rate's sample).
        on_run: hears each run as it ends (system name, timing): progress for a long bench.
    """

    for _, w in systems_wanted.values():
        engine.adapter.model_for(w)  # each format's decode copy, made before any run is timed

    def ragkv_system(mode: str, weights: str) -> Callable[[PeerPrompt], Run]:
        return lambda p: ragkv_run(engine, p, mode, decode_tokens, weights)

    systems = {name: ragkv_system(mode, w) for name, (mode, w) in systems_wanted.items()}
    if llm is not None:
        peer = llm
        systems["llama.cpp full"] = lambda p: peer.run(p, decode_tokens, warm=False)
        systems["llama.cpp warm prefix"] = lambda p: peer.run(p, decode_tokens, warm=True)
    for p in prompts:  # untimed: stores the chunk caches, warms allocators
        ragkv_run(engine, p, "reuse", 2)
    runs: dict[str, list[Run]] = {name: [] for name in systems}
    for _ in range(repeats):
        for p in prompts:
            for name, run in systems.items():
                runs[name].append(run(p))
                if on_run is not None:
                    on_run(name, runs[name][-1])
    rows = [_summary(name, r) for name, r in runs.items()]
    base = next((r for r in rows if r["system"] == "llama.cpp full"), None)
    for row in rows:
        if base is not None:
            row["vs_llama"] = row["answer_s"] / base["answer_s"]
    return rows


def format_peer_table(rows: Sequence[dict[str, Any]]) -> str:
    return format_table(rows, COLUMNS)


# ---- decode-step anatomy: the int8 error and the time outside matmuls ----------------------------------
_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
            "quantized::linear_dynamic_fp16", PROFILED_NAME)  # fmt: skip


def _step_ms(step: Callable[[int], torch.Tensor], tokens: Sequence[int]) -> tuple[float, float]:
    """(median ms per step, mean ms per step inside matmul kernels): timed plainly, then under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step(tokens[0])  # first-call work (kernel selection, weight prepacking) is not a step's cost
    half = len(tokens) // 2
    times = []
    for t in tokens[1:half]:
        t0 = time.perf_counter()
        step(t)
        times.append((time.perf_counter() - t0) * 1000)
    wall = statistics.median(times)  # a step that other work on the machine stalled does not count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for t in tokens[half:]:
            step(t)
    mm_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in _MATMULS)
    return wall, mm_us / 1000 / (len(tokens) - half)


def decode_anatomy(adapter: Any, ids: Sequence[int], steps: int = 32) -> list[dict[str, Any]]:
    """Per decode-weight format: ms per token, of which outside matmuls, and KL against the model's weights.

    The answer is the model-weights greedy continuation of ``ids`` (end tokens ignored), fed to every
    format (teacher forcing), so each step's logits compare position by position.
    """
    from ragkv.model.attention import DECODE_WEIGHTS
    from ragkv.model.batch import one_row

    cache = adapter.build_cache([])
    with torch.inference_mode():
        first = adapter.forward(list(ids), cache, 0, logits="last")[-1]
        answer = [int(first.argmax())]
        ref_step = one_row(adapter, cache, len(ids), steps)
        ref = []
        for _ in range(steps):
            ref.append(ref_step(answer[-1]))
            answer.append(int(ref[-1].argmax()))
        rows = []
        for weights in DECODE_WEIGHTS:
            step = one_row(adapter, cache, len(ids), steps, weights)  # type: ignore[arg-type]
            got = [step(t) for t in answer[:steps]]
            ref_lp = torch.stack(ref).log_softmax(-1)
            got_lp = torch.stack(got).log_softmax(-1)
            kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1)  # [steps] KL(model || format)
            agree = (torch.stack(got).argmax(-1) == torch.stack(ref).argmax(-1)).float().mean()
            timing = one_row(adapter, cache, len(ids), steps, weights)  # type: ignore[arg-type]
            wall, mm = _step_ms(timing, answer[:steps])
            rows.append(
                {
                    "weights": weights,
                    "ms_token": wall,
                    "matmul_ms": mm,
                    "outside_ms": wall - mm,
                    "kl_mean": float(kl.mean()),
                    "kl_max": float(kl.max()),
                    "top1": float(agree),
                }
            )
    return rows


ANATOMY_COLUMNS = (
    Column("weights", "decode weights"),
    Column("ms_token", "ms/token", "{:.1f}"),
    Column("matmul_ms", "in matmuls", "{:.1f}"),
    Column("outside_ms", "outside matmuls", "{:.1f}"),
    Column("kl_mean", "KL mean", "{:.4f}"),
    Column("kl_max", "KL max", "{:.3f}"),
    Column("top1", "top-1 agree", "{:.0%}"),
)


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` other processes, each keeping one core busy, for the block: "with another job running"."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(max(0, n))
    ]
    try:
        time.sleep(1.0 if procs else 0.0)  # let the thread policy see them before the first run
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


# what torch's OpenMP runtime read when it loaded (with torch, before any setdefault below): passive
# waits cost ragkv's decode 20-30% (a thread woken from sleep at each of a step's ~200 parallel regions)
_RAGKV_WAITS = os.environ.get("OMP_WAIT_POLICY", "")


def machine_load() -> str:
    """The load averages and the thread settings, for the line under the table."""
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux/macOS
        load = "unknown"
    policy = os.environ.get("RAGKV_THREADS", "auto")
    return (
        f"load average {load}; {torch.get_num_threads()} threads now (RAGKV_THREADS={policy}); "
        f"OMP_WAIT_POLICY ragkv {_RAGKV_WAITS or 'unset'}, llama.cpp PASSIVE"
    )


def bench_engine(adapter: Any, decode_weights: str, data_dir: Path) -> Any:
    """An engine over ``adapter`` with a memory tier and a hashing embedder, its files in ``data_dir``."""
    from ragkv.engine import EngineConfig, RagKV
    from ragkv.retriever.embedder import HashingEmbedder

    cfg = EngineConfig(data_dir=data_dir, store=("memory://",), decode_weights=decode_weights)
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def gguf_path(model: str) -> Path:
    """The GGUF file ``model`` names (a path or an alias), which both sides load."""
    from ragkv.model.loading import ALIASES, _package_dir

    if model in ALIASES:
        package, filename = ALIASES[model]
        return _package_dir(package) / filename
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"bench peer needs a .gguf file (both sides load the same file); got {model!r}")
    return path
