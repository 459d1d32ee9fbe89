"""What the codec's levels change in the adaptive loader's choice (issue 26): ``plan_load`` on measured rows.

    python experiments/codec_planner_effect.py ROWS.json [--tokens 400] [--chunks 4] [--tps 900]

ROWS.json is ``ragkv bench codec --json`` output (with ``--calibrate``, the ``cachegen+klt`` rows
too). Each stored set ranks its levels by measured KL, best first, as ``index_codecs`` would list
them; a prompt of ``--chunks`` chunks of ``--tokens`` tokens is planned at 10 and 100 Mbit/s with
the engine's default (5% TTFT slack, 15% of loaded tokens recomputed by fusion), decode speeds
from the rows (fp16-equivalent MB/s turned into encoded bytes/s), prefill at ``--tps`` tokens/s.
Prints the choice, its estimated load time and the chosen level's KL.
"""

from __future__ import annotations

import argparse
import json

from ragkv.planner.plan import ChunkOptions, Rates, choice_name, plan_load
from ragkv.types import CodecSpec

_SETS = {
    "today (cachegen 0-5)": ("cachegen",),
    "with the transform (cachegen+klt 0-5)": ("cachegen+klt",),
    "both": ("cachegen", "cachegen+klt"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--tps", type=float, default=900.0)
    args = parser.parse_args()
    rows = json.load(open(args.rows))  # noqa: SIM115
    if isinstance(rows, dict):
        rows = rows.get("rows", rows)
    fp16 = next(r["bytes_per_token"] for r in rows if r["codec"] == "raw")
    print("| stored | link | choice | est. load s | KL of the choice | bytes/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, codecs in _SETS.items():
        chosen = sorted((r for r in rows if r["codec"] in codecs), key=lambda r: r["kl"])
        if not chosen:
            continue
        specs = {CodecSpec(r["codec"].replace("+", "-"), r["level"]): r for r in chosen}
        order = list(specs)
        chunk = ChunkOptions(args.tokens, {s: round(r["bytes_per_token"] * args.tokens) for s, r in specs.items()})
        decode = {str(s): r["decode_mbps"] * 1e6 * r["bytes_per_token"] / fp16 for s, r in specs.items()}
        for mbit in (10, 100):
            rates = Rates(mbit * 1e6 / 8, args.tps, decode, latency_s=0.002, fusion_ratio=0.15)
            plan = plan_load([chunk] * args.chunks, order, rates, slack=0.05)
            picks = [choice_name(c) for c in plan.choices]
            first = plan.choices[0]
            row = specs.get(first) if isinstance(first, CodecSpec) else None
            kl = f"{row['kl']:.4f}" if row else "0 (text)"
            size = f"{row['bytes_per_token']:,.0f}" if row else "-"
            print(f"| {name} | {mbit} Mbit/s | {', '.join(picks)} | {plan.seconds:.2f} | {kl} | {size} |")


if __name__ == "__main__":
    main()
