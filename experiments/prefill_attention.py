"""A plain prefill's attention on ragkv's kernel against torch's SDPA: per call and in whole prefills.

Since fusion's passes run their attention in ragkv's kernel (``ragkv.model.native_attention``), a
plain prefill pass (a whole prompt from an empty cache, or a piece after cached tokens: chunked
prefill, a chunk after the shared prefix at index time, a prompt-cache continuation) is the same
case with the queries at the last slots. ``ModelAdapter.forward`` takes the kernel there where it
pays (``ModelAdapter._prefill_steer``). This measures where it pays:

- per call (ms), bf16 and fp32, Qwen2.5 0.5B's heads (14 query, 2 KV, 64 dims) and 1.5B's (12, 2,
  128): a whole prompt (is_causal SDPA, as transformers calls it) and pieces of 256 queries after
  a cached context (SDPA with the additive mask), with K/V repeated per query head as transformers'
  SDPA path does;
- with ``--model M``: whole prefills of the own QA set's first ``--prompts`` prompts, in one pass and
  in pieces of ``--piece`` tokens, on the kernel and on torch's attention (ms, the median of
  ``--rounds``), with the KL of each last-token distribution to the model's in fp32 (the
  reference that rounds least), and one pass computing the logits at every position (the LM head
  over the whole prompt, as the benches' full-prefill baseline did until commit f08e5af) against
  one computing the last position's only.

    python experiments/prefill_attention.py
    python experiments/prefill_attention.py --prompts 6 \\
        --model ~/.cache/ragkv-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from attention_cpu import timed  # the same per-call timer

from ragkv.model.native_attention import attention_available, scatter_attention


def one_shape(dt: torch.dtype, hq: int, hkv: int, d: int, start: int, count: int) -> tuple[float, float]:
    """ms per call of SDPA (as transformers calls it) and of the kernel: ``count`` queries after ``start`` keys."""
    gen = torch.Generator().manual_seed(0)
    keys = start + count
    q = torch.randn(1, hq, count, d, generator=gen).to(dt)
    k, v = (torch.randn(1, hkv, keys, d, generator=gen).to(dt) for _ in range(2))
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    pos = torch.arange(start, keys)
    mask = None
    if start:  # a piece after cached tokens: transformers hands SDPA the additive causal mask
        blocked = torch.arange(keys).unsqueeze(0) > pos.unsqueeze(1)
        mask = torch.zeros(1, 1, count, keys, dtype=dt).masked_fill_(blocked, torch.finfo(dt).min)
    sdpa = timed(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, is_causal=mask is None), 10)
    return sdpa, timed(lambda: scatter_attention(q, k, v, pos, d**-0.5), 10)


def per_call(dt: torch.dtype) -> None:
    """Print ms per call, SDPA against the kernel, for whole prompts and for pieces after a context."""
    for hq, hkv, d in ((14, 2, 64), (12, 2, 128)):
        for start, count in ((0, 512), (0, 1536), (1280, 256), (3840, 256)):
            a, b = one_shape(dt, hq, hkv, d, start, count)
            shape = f"{dt} heads {hq}/{hkv}x{d}, {count} queries after {start}"
            print(f"{shape}: sdpa {a:.2f} ms, kernel {b:.2f} ms, {a / b:.2f}x")


@torch.inference_mode()
def whole_prefills(model: str, prompts: int, piece: int, rounds: int) -> None:
    """Whole prefills of ``model`` (in the dtype ``auto`` picks) on the kernel and on torch's attention."""
    from ragkv.bench.qa_data import build_prompt, load_qa_set
    from ragkv.model import ModelAdapter, load_model
    from ragkv.model.attention import PLAIN
    from ragkv.types import LogitsWanted

    adapter = load_model(model, dtype="auto")
    reference = load_model(model, dtype="float32")
    qa = load_qa_set(None)
    head_all: list[float] = []  # a one-pass prefill with logits at every position, over one with the last only
    off = mock.patch.object(ModelAdapter, "_prefill_steer", lambda self, cache, start, count: PLAIN)
    rows: dict[str, dict[str, list[float]]] = {
        name: {"one pass ms": [], "pieces ms": [], "KL to fp32": []} for name in ("kernel", "torch")
    }

    def prefill(a: ModelAdapter, ids: list[int], size: int, logits: LogitsWanted = "last") -> torch.Tensor:
        cache = a.build_cache([])
        out = None
        for s in range(0, len(ids), size):
            out = a.forward(ids[s : s + size], cache, s, logits=logits)
        assert out is not None
        return out[-1]

    for question in qa.questions[:prompts]:
        p = build_prompt(qa, question, lambda t: len(adapter.encode(t)))
        prefix, chunks, suffix = adapter.chat_segments(p.get("system"), p["chunks"], p["question"])
        ids = prefix + [t for c in chunks for t in c] + suffix
        ref = torch.log_softmax(prefill(reference, ids, len(ids)).float(), -1)
        for name in ("kernel", "torch"):
            if name == "torch":
                off.start()
            try:
                for size, key in ((len(ids), "one pass ms"), (piece, "pieces ms")):
                    times = []
                    for _ in range(rounds):
                        t = time.perf_counter()
                        logits = prefill(adapter, ids, size)
                        times.append((time.perf_counter() - t) * 1000)
                    rows[name][key].append(statistics.median(times))
                got = torch.log_softmax(logits.float(), -1)
                rows[name]["KL to fp32"].append(float((ref.exp() * (ref - got)).sum()))
                if name == "kernel":  # what the benches' baseline timed until commit f08e5af
                    t = time.perf_counter()
                    prefill(adapter, ids, len(ids), "all")
                    head_all.append((time.perf_counter() - t) * 1000 / rows[name]["one pass ms"][-1])
            finally:
                if name == "torch":
                    off.stop()
        print(
            f"{question.id} ({len(ids)} tokens): kernel {rows['kernel']['one pass ms'][-1]:.0f} / "
            f"{rows['kernel']['pieces ms'][-1]:.0f} ms, torch {rows['torch']['one pass ms'][-1]:.0f} / "
            f"{rows['torch']['pieces ms'][-1]:.0f} ms (one pass / pieces of {piece})",
            flush=True,
        )
    print(f"{adapter.name}, {adapter.dtype}, {torch.get_num_threads()} threads, medians over {prompts} prompts:")
    for name, cols in rows.items():
        print(f"  {name}: " + ", ".join(f"{k} {statistics.median(v):.4g}" for k, v in cols.items()))
    print(f"  one pass with every position's logits / the last's only: median {statistics.median(head_all):.2f}x")
    for key in ("one pass ms", "pieces ms"):
        ratio = [t / k for t, k in zip(rows["torch"][key], rows["kernel"][key], strict=True)]
        print(f"  torch / kernel, {key.removesuffix(' ms')}: median {statistics.median(ratio):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="also time whole prefills of this model")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--piece", type=int, default=256, help="tokens per piece of the chunked prefill")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads; ms per call")
    for dt in (torch.bfloat16, torch.float32):
        if attention_available(dt):
            per_call(dt)
    if args.model:
        whole_prefills(args.model, args.prompts, args.piece, args.rounds)


if __name__ == "__main__":
    main()
