"""Fusion's attention on a CPU: torch's SDPA against three ways around it, per call and in a whole fusion.

A fused prefill's recomputed tokens sit at scattered positions, so each layer's attention takes an
exact causal mask over the whole context. Per call (ms, bf16 where the CPU has native bf16 matmuls,
else fp32; queries at sorted random positions over ``--keys`` keys), for SmolLM2-135M's heads
(9 query, 3 KV, 64 dims) and Qwen2.5 0.5B's (14, 2, 64):

- ``sdpa``: what runs today (transformers' SDPA path: K/V repeated per query head, additive mask);
- ``key_cut``: the queries in 4 blocks, each over the keys up to its last position only;
- ``manual``: two bf16 matrix products with an fp32 softmax between them;
- ``grouped``: the query heads of a KV head stacked as rows of one SDPA call (exact);
- ``eager``: transformers' eager form in the model's dtype (``baddbmm`` with the mask, softmax,
  ``bmm``): faster, but the scores are rounded to bf16 before the softmax.
- ``native``: ragkv's own kernel (:mod:`ragkv.model.native_attention`: AVX512-BF16 in bf16, AVX2 in fp32),
  from the queries' positions; ``*_err_fp64`` is the mean distance of it and of ``sdpa`` to the
  attention computed in fp64, ``*_rounded_exact`` the share of their outputs that are that
  attention rounded once to the model's dtype.

With ``--fusion`` it also times whole fusions of the default model on the own QA set's first
question with ``key_cut`` patched into transformers' SDPA, against the plain path.

    python experiments/attention_cpu.py --fusion
    python experiments/attention_cpu.py --eager-fusion 4   # the eager form in whole fusions: ms and KL
    python experiments/attention_cpu.py --native-fusion 12   # ragkv's kernel in whole fusions: ms and KL
    python experiments/attention_cpu.py --fp32   # per call in fp32 (ragkv's AVX2 kernel against SDPA)

Run it on a quiet machine. docs/benchmarks.md ("vLLM connector", on a CPU with AVX-512 and bf16)
quotes one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ragkv.model.native_attention import attention_available, scatter_attention
from ragkv.model.placement import cpu_has_native_bf16

BLOCKS = 4


def timed(f: Callable[[], Any], n: int = 30) -> float:
    """Mean ms of ``f`` over ``n`` calls, after one warm-up."""
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1000


def per_call(hq: int, hkv: int, d: int, q: int, kv: int, dt: torch.dtype) -> dict[str, float]:
    """ms per call of each variant for ``q`` queries over ``kv`` keys (and the largest difference to ``sdpa``)."""
    g = hq // hkv
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, h, n, d, generator=gen).to(dt) for h, n in ((hq, q), (hkv, kv), (hkv, kv)))
    pos = torch.sort(torch.randperm(kv, generator=gen)[:q]).values
    blocked = torch.arange(kv)[None, :] > pos[:, None]
    mask = torch.zeros(1, 1, q, kv, dtype=dt).masked_fill_(blocked, torch.finfo(dt).min)
    mask_f = torch.zeros(1, 1, 1, q, kv).masked_fill_(blocked, float("-inf"))
    mask_g = mask.repeat(1, 1, g, 1)
    edges = [round(i * q / BLOCKS) for i in range(BLOCKS + 1)]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(Q, K.repeat_interleave(g, 1), V.repeat_interleave(g, 1), attn_mask=mask)

    def key_cut() -> torch.Tensor:
        kr, vr = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
        outs = []
        for s, e in zip(edges, edges[1:], strict=False):
            m = int(pos[e - 1]) + 1
            outs.append(
                F.scaled_dot_product_attention(Q[:, :, s:e], kr[:, :, :m], vr[:, :, :m], attn_mask=mask[:, :, s:e, :m])
            )
        return torch.cat(outs, dim=2)

    def manual() -> torch.Tensor:
        s = torch.matmul(Q.reshape(1, hkv, g * q, d), K.transpose(-1, -2)).view(1, hkv, g, q, kv).float()
        s.mul_(d**-0.5).add_(mask_f)
        p = torch.softmax(s, -1).to(dt).view(1, hkv, g * q, kv)
        return torch.matmul(p, V).view(1, hq, q, d)

    def grouped() -> torch.Tensor:
        return F.scaled_dot_product_attention(Q.reshape(1, hkv, g * q, d), K, V, attn_mask=mask_g).view(1, hq, q, d)

    def eager() -> torch.Tensor:
        return _eager_attention(Q, K, V, mask, d**-0.5).transpose(1, 2)

    def native() -> torch.Tensor:
        return scatter_attention(Q, K, V, pos, d**-0.5).transpose(1, 2)

    variants = [("sdpa", sdpa), ("key_cut", key_cut), ("manual", manual), ("grouped", grouped), ("eager", eager)]
    if attention_available(dt):
        variants.append(("native", native))
    ref = sdpa().float()
    k64, v64 = K.double().repeat_interleave(g, 1), V.double().repeat_interleave(g, 1)
    exact = F.scaled_dot_product_attention(Q.double(), k64, v64, attn_mask=blocked.logical_not())
    out: dict[str, float] = {}
    for name, f in variants:
        out[name] = round(timed(f), 2)
        if name != "sdpa":
            out[f"{name}_max_diff"] = round((f().float() - ref).abs().max().item(), 4)
        if name in ("sdpa", "native"):  # mean distance to the attention computed in fp64, share of it rounded once
            out[f"{name}_err_fp64"] = float(f"{(f().double() - exact).abs().mean().item():.3g}")
            out[f"{name}_rounded_exact"] = round((f() == exact.float().to(dt)).double().mean().item(), 4)
    return out


def _eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """transformers' eager form for one sequence, in the model's dtype: scores (rounded to it) plus the
    additive mask in one ``baddbmm``, softmax, ``bmm``; query heads of a KV head stacked as rows.
    Returns ``[1, q, Hq, D]`` as transformers' attention functions do."""
    _, hq, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    g = hq // hkv
    rows = mask[0, 0, :, :kv].expand(g, q, kv).reshape(g * q, kv)  # [G * q, kv]: the same for every KV head
    scores = torch.baddbmm(rows, query.reshape(hkv, g * q, d), key[0].transpose(-1, -2), alpha=scale)
    out = torch.bmm(torch.softmax(scores, -1), value[0])  # [Hkv, G * q, D]
    return out.view(1, hq, q, d).transpose(1, 2).contiguous()


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    lp, lq = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    return round(float((lp.exp() * (lp - lq)).sum()), 5)


def compare_fusions(
    model: str, questions: int, rounds: int, names: tuple[str, str], switch: Callable[[str], None], full_ref: bool
) -> None:
    """Whole default fusions of ``model`` on the own QA set's first ``questions``, each of ``names``
    switched on by ``switch(name)`` in turn: ms per fusion, and the KL of the last suffix token's
    distribution to the reference: full prefill of the prompt (``full_ref``), else a fusion that
    recomputes every chunk token (ratio 1) with ``names[0]``."""
    from ragkv.bench.qa_data import build_prompt, load_qa_set
    from ragkv.fusion import FusionConfig, FusionInput, fuse
    from ragkv.model import load_model

    a = load_model(model, device="cpu", dtype="auto")
    qa = load_qa_set(None)
    times: dict[str, list[int]] = {n: [] for n in names}
    kls: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for question in qa.questions[:questions]:
            p = build_prompt(qa, question, lambda t: len(a.encode(t)))
            prefix, chunks, suffix = a.chat_segments(p.get("system"), p["chunks"], p["question"])
            pre = a.prefill_kv(prefix)
            inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in chunks], chunks, suffix)
            switch(names[0])
            ref: torch.Tensor | None
            if full_ref:
                ids = prefix + [t for c in chunks for t in c] + suffix
                ref = a.forward(ids, a.build_cache([]), 0, logits="last")
            else:
                ref = fuse(a, inp, FusionConfig(ratio=1.0), prefill_suffix=True).suffix_logits
            for r in range(rounds):
                for name in names:
                    switch(name)
                    t = time.perf_counter()
                    got = fuse(a, inp, FusionConfig(), prefill_suffix=True).suffix_logits
                    times[name].append(round((time.perf_counter() - t) * 1000))
                    if r == 0 and ref is not None and got is not None:
                        kls[name].append(_kl(ref[-1], got[-1]))
    print(f"whole fusion, ms per round ({a.dtype}): {times}")
    print(f"KL of the last suffix token to {'full prefill' if full_ref else 'a ratio-1 fusion'}, per question: {kls}")
    for name in names:
        print(f"  {name}: median {statistics.median(times[name])} ms, mean KL {statistics.mean(kls[name]):.4f}")


def native_fusion(model: str, questions: int, rounds: int) -> None:
    """Whole fusions on ragkv's native kernel against torch's SDPA (``ModelAdapter.scattered`` as PLAIN)."""
    from unittest import mock

    from ragkv.model import ModelAdapter
    from ragkv.model.attention import PLAIN

    scattered = ModelAdapter.scattered
    patch = mock.patch.object(ModelAdapter, "scattered", lambda self, pos: PLAIN)

    def switch(name: str) -> None:
        if name == "sdpa" and ModelAdapter.scattered is scattered:
            patch.start()
        elif name == "native" and ModelAdapter.scattered is not scattered:
            patch.stop()

    try:
        compare_fusions(model, questions, rounds, ("sdpa", "native"), switch, full_ref=True)
    finally:
        switch("native")


def eager_fusion(questions: int, rounds: int) -> None:
    """Whole default-model fusions with ``_eager_attention`` patched in for fusion's additive-masked
    calls, against torch's SDPA: ms per fusion, and the KL of the last suffix token's distribution
    to that of a fusion recomputing every chunk token (ratio 1), per question of the own QA set."""
    from unittest import mock

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ragkv.model import ModelAdapter
    from ragkv.model.attention import PLAIN

    plain = ALL_ATTENTION_FUNCTIONS["sdpa"]
    on = [False]

    def patched(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, *a: Any, **kw: Any
    ) -> Any:
        additive = isinstance(mask, torch.Tensor) and mask.dtype != torch.bool
        if not on[0] or not additive or query.shape[2] < 2 or kw.get("softcap") or kw.get("dropout"):
            return plain(module, query, key, value, mask, *a, **kw)
        scale = kw.get("scaling") or query.shape[-1] ** -0.5
        return _eager_attention(query, key, value, mask, scale), None

    def switch(name: str) -> None:
        on[0] = name == "eager"

    ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = patched
    try:
        # torch's attention only, every fused call through the registry's SDPA function (ragkv's own
        # call, by blocks or for grouped heads, would bypass the patch)
        with (
            mock.patch.object(ModelAdapter, "scattered", lambda self, pos: PLAIN),
            mock.patch("ragkv.model.attention._blocks_apply", lambda *a, **k: False),
        ):
            compare_fusions("smollm2-135m", questions, rounds, ("sdpa", "eager"), switch, full_ref=False)
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = plain


def whole_fusion(rounds: int) -> None:
    """ms of a whole default-model fusion with ``key_cut`` patched into transformers' SDPA, and without."""
    from unittest import mock

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ragkv.bench.qa_data import build_prompt, load_qa_set
    from ragkv.fusion import FusionConfig, FusionInput, fuse
    from ragkv.model import load_model

    plain = ALL_ATTENTION_FUNCTIONS["sdpa"]
    cut = [False]

    def patched(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, *a: Any, **kw: Any
    ) -> Any:
        q = query.shape[2]
        if not cut[0] or mask is None or q < 64:
            return plain(module, query, key, value, mask, *a, **kw)
        allowed = (mask[0, 0] == 0).sum(-1).tolist()  # keys each query row sees (rows sorted by position)
        edges = [round(i * q / BLOCKS) for i in range(BLOCKS + 1)]
        outs = []
        for s, e in zip(edges, edges[1:], strict=False):
            m = max(allowed[s:e])
            o, _ = plain(module, query[:, :, s:e], key[:, :, :m], value[:, :, :m], mask[:, :, s:e, :m], *a, **kw)
            outs.append(o)
        return torch.cat(outs, dim=1), None

    ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = patched
    try:
        a = load_model("smollm2-135m", device="cpu", dtype="auto")
        qa = load_qa_set(None)
        p = build_prompt(qa, qa.questions[0], lambda t: len(a.encode(t)))
        prefix, chunks, suffix = a.chat_segments(p.get("system"), p["chunks"], p["question"])
        pre = a.prefill_kv(prefix)
        cached = [a.prefill_kv(c, past=[pre]) for c in chunks]
        times: dict[str, list[int]] = {"plain": [], "key_cut": []}
        # every call the CPU kernel leaves through the registry's SDPA function (the patch above)
        with torch.inference_mode(), mock.patch("ragkv.model.attention._blocks_apply", lambda *a, **k: False):
            for _ in range(rounds):
                for name in times:
                    cut[0] = name == "key_cut"
                    t = time.perf_counter()
                    fuse(a, FusionInput(pre, cached, chunks, suffix), FusionConfig(), prefill_suffix=True)
                    times[name].append(round((time.perf_counter() - t) * 1000))
        print(f"whole fusion, ms per round ({a.dtype}): {times}")
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = plain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1535)
    ap.add_argument("--fusion", action="store_true", help="also time whole fusions with key_cut patched in")
    ap.add_argument(
        "--eager-fusion",
        type=int,
        default=0,
        metavar="N",
        help="also time whole fusions of N questions with transformers' eager form patched in",
    )
    ap.add_argument(
        "--native-fusion",
        type=int,
        default=0,
        metavar="N",
        help="also time whole fusions of N questions on ragkv's native kernel against torch's SDPA",
    )
    ap.add_argument("--model", default="smollm2-135m", help="the model of --native-fusion")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="per call in fp32 even where the CPU has native bf16")
    args = ap.parse_args()
    dt = torch.bfloat16 if cpu_has_native_bf16() and not args.fp32 else torch.float32
    print(f"{torch.get_num_threads()} threads, {dt}, {args.keys} keys; ms per call")
    for hq, hkv, d in ((9, 3, 64), (14, 2, 64)):
        for q in (20, 100, 300, 600):
            print(f"heads {hq}/{hkv}x{d}, {q} queries:", per_call(hq, hkv, d, q, args.keys, dt))
    if args.fusion:
        whole_fusion(args.rounds)
    if args.eager_fusion:
        eager_fusion(args.eager_fusion, args.rounds)
    if args.native_fusion:
        native_fusion(args.model, args.native_fusion, args.rounds)


if __name__ == "__main__":
    main()
