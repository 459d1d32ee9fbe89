"""The channel transform as indexing calibrates it (issue 26): held-out KL, and bytes `ragkv index` stores.

    python experiments/index_transform.py kl [--model M] [--report 4]
    python experiments/index_transform.py index [--model M] [--levels 1]

``kl``: the transform calibrated the way ``ChunkComputer.ensure_transform`` does at index time (the
first chunks' prefill, 2048 tokens; sensitivity measured on each chunk's own last 16 tokens, no
question) on builtin prompts 4-7, then ``run_codec_bench`` on packages prompts 0..report-1 (held
out): rows ``cachegen`` and ``cachegen+klt`` per level. ``index``: what ``ragkv index`` does to the
demo corpus (the stdlib docs ``ragkv demo`` indexes), into a fresh data dir per run, at each level
with the transform off and on: chunks, bytes stored, seconds.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ragkv.bench.codec import format_table, run_codec_bench
from ragkv.bench.prompt_sets import prompt_set
from ragkv.cache.store import open_store
from ragkv.engine import EngineConfig, RagKV
from ragkv.model import load_model
from ragkv.retriever.corpus import stdlib_corpus
from ragkv.retriever.kv_retriever import RetrieverConfig
from ragkv.retriever.transforms import TransformConfig, TransformSource
from ragkv.types import CodecSpec


def held_out_kl(model: str, report: int, sensitivity: bool = True) -> None:
    adapter = load_model(model, dtype="auto")
    layout = adapter.layout(None)
    segments = [
        adapter.encode(layout.chunk_text(text.strip()))
        for p in prompt_set("builtin", adapter, n=8, max_tokens=2000)[4:]
        for text in p["chunks"]
    ]
    source = TransformSource(
        adapter, open_store(["memory://"]), tenant="bench", config=TransformConfig(sensitivity=sensitivity)
    )
    transform = source.ensure(adapter.prefill_kv(adapter.encode(layout.prefix)), segments)
    print(f"keys in {sum(transform.enabled[0])}, values in {sum(transform.enabled[1])} of {transform.shape[0]} layers")
    prompts = prompt_set("packages", adapter, n=report, max_tokens=2000)
    rows = run_codec_bench(
        adapter, prompts, codecs={"cachegen": (0, 1, 2, 3), "int8": (0,)}, decode_repeats=1, transform=transform
    )
    print(format_table(rows))


def index_bytes(model: str, levels: list[int]) -> None:
    adapter = load_model(model, dtype="auto")
    embedder = None
    print("| level | transform | chunks | bytes stored | seconds |\n| --- | --- | --- | --- | --- |")
    for level in levels:
        for name, transform in (("off", TransformConfig(levels=())), ("on", TransformConfig(levels=(level,)))):
            with tempfile.TemporaryDirectory() as d:
                config = RetrieverConfig(codec=CodecSpec("cachegen", level), transform=transform)
                with RagKV(EngineConfig(data_dir=Path(d), retriever=config), adapter=adapter, embedder=embedder) as rag:
                    embedder = rag.retriever.embedder
                    r = rag.index(stdlib_corpus(), progress=False)
            print(f"| {level} | {name} | {r.chunks} | {r.bytes_stored:,} | {r.seconds:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kl", "index"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--report", type=int, default=4)
    parser.add_argument("--levels", default="1")
    parser.add_argument("--no-sensitivity", action="store_true", help="kl: the basis alone (no step scales)")
    args = parser.parse_args()
    if args.what == "kl":
        held_out_kl(args.model, args.report, sensitivity=not args.no_sensitivity)
    else:
        index_bytes(args.model, [int(v) for v in args.levels.split(",")])


if __name__ == "__main__":
    main()
