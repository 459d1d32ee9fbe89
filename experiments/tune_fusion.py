"""Fast fusion tuning: KL, top-1 and a rough TTFT ratio (no greedy answers per method).

    python experiments/tune_fusion.py 4 '{"method": "blend", "ratio": 0.15}' '{"method": "query_focus", "ratio": 0.15}'
    python experiments/tune_fusion.py --prompts packages 4 '{"method": "query_focus", "ratio": 0.15}'

Uses the first N prompts of a set of ``ragkv bench fusion`` (``--prompts builtin``, the default,
or ``packages``: ragkv.bench.prompt_sets); each argument after N is a JSON
object: ``method``, ``ratio`` and any fields of the method's parameter record (e.g.
``narrow_layer`` for ``QueryFocusParams``). Reference: full prefill's 32-token greedy answer.
The Cache-Craft methods (``craft``, ``craft_query``: ``experiments/craft.py``, registered here) get
the deviation they rank by recorded per chunk, untimed, after chunks of the other prompts.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch
from craft import craft_contexts, stored_scores  # registers craft and craft_query

from ragkv.bench.fusion import ANSWER_TOKENS, _kl_top1
from ragkv.bench.prompt_sets import prompt_set
from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.generation import GenerationConfig, decode_loop
from ragkv.model import load_model
from ragkv.selection import strategy_class


def _config(fields: dict) -> FusionConfig:
    """``{"method": ..., "ratio": ..., <knobs of the method's record>}`` -> FusionConfig."""
    cfg = FusionConfig(**{k: fields.pop(k) for k in ("method", "ratio") if k in fields})
    return replace(cfg, params=strategy_class(cfg.method).Params(**fields)) if fields else cfg


@torch.inference_mode()
def main(argv: list[str]) -> None:
    name = "builtin"
    if argv[:1] == ["--prompts"]:
        name, argv = argv[1], argv[2:]
    adapter = load_model("smollm2-135m")
    n, configs = int(argv[0]), [_config(json.loads(a)) for a in argv[1:]]
    cases = []
    prompts = prompt_set(name, adapter, n=n)
    craft = any(cfg.strategy().wants_stored_scores for cfg in configs)
    for i, p in enumerate(prompts):
        scores = stored_scores(adapter, p, craft_contexts(prompts, i)) if craft else None  # index time
        prefix, chunks, suffix = adapter.chat_segments(None, p["chunks"], p["question"])
        ctx = prefix + [t for c in chunks for t in c]
        cache = adapter.build_cache([])
        t_full = time.perf_counter()
        logits = adapter.forward(ctx + suffix, cache, 0, logits="last")  # as an engine: the last logits only
        int(logits[-1].argmax())  # wait for the result (asynchronous devices)
        t_full = time.perf_counter() - t_full
        start = len(ctx) + len(suffix)
        answer = list(decode_loop(adapter, cache, logits[-1], start, GenerationConfig(max_new_tokens=ANSWER_TOKENS)))
        adapter.crop_cache(cache, start)
        ref = torch.cat([logits[-1:], adapter.forward(answer[:-1], cache, start)])[: len(answer)]
        pre = adapter.prefill_kv(prefix)
        cached = [adapter.prefill_kv(c, past=[pre]) for c in chunks]
        cases.append((FusionInput(pre, cached, chunks, suffix, stored_scores=scores), answer, ref, len(ctx), t_full))
    print("prompt tokens", [c[-2] for c in cases], flush=True)
    for cfg in configs:
        t0, kls, top1s, shares, ttfts = time.perf_counter(), [], [], [], []
        for inp, answer, ref, n_ctx, t_full in cases:
            t_fuse = time.perf_counter()
            fused = fuse(adapter, inp, cfg, prefill_suffix=True)
            assert fused.suffix_logits is not None
            first = fused.suffix_logits[-1:]
            int(first.argmax())  # wait for the result (asynchronous devices)
            ttfts.append((time.perf_counter() - t_fuse) / t_full)
            start = n_ctx + len(inp.suffix_ids)
            got = torch.cat([first, adapter.forward(answer[:-1], fused.cache, start)])[: len(answer)]
            kl, top1 = _kl_top1(ref, got)
            kls.append(kl)
            top1s.append(top1)
            shares.append(fused.recomputed_tokens / max(1, fused.chunk_tokens))
        print(
            f"{cfg} | KL {sum(kls) / len(kls):.4f} top1 {sum(top1s) / len(top1s):.3f} "
            f"recompute {sum(shares) / len(shares):.3f} ttft/full {sum(ttfts) / len(ttfts):.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
