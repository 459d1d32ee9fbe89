"""How many kernels a decoder layer of the fused prefill launches outside CUDA graphs, counted on the CPU.

    python experiments/graph_launches.py [--family llama] [--rows 32] [--context 512]

On a GPU the question probe and the recompute are bound by the host: each kernel launch costs
microseconds of Python and dispatch whatever its size. ``ragkv.gpu.graphs`` replays a layer as two
CUDA graphs with the attention eager between them. This counts, per layer, the ATen operations
that run a kernel (views excluded, but a ``reshape`` that copies counted) as fusion issues them,
on a tiny random model of the family (the count does not depend on the widths):

- through the model's own decoder layers (transformers', ``RAGKV_*_GRAPHS=0``);
- through the replayed layers (``RAGKV_*_GRAPHS=eager``: the same buffers and order as on a GPU,
  each replay counted as one launch, as a graph launch is one).

The attention runs torch's SDPA here, as on a GPU (ragkv's CPU attention kernel is switched off).
No timing: the counts are exact and the same on any machine. docs/gpu.md ("The question probe") quotes them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragkv.fusion import _question_attention, _run_layer, _Step  # noqa: E402
from ragkv.gpu import graphs  # noqa: E402
from ragkv.model import ModelAdapter, load_model  # noqa: E402
from ragkv.model.attention import PLAIN  # noqa: E402

_NO_KERNEL = {"_fused_sdp_choice"}  # asks which kernel SDPA would pick: host work only


class _Count(TorchDispatchMode):
    """Counts the ATen operations that run a kernel while active: not views (but a ``reshape`` that
    copies, as repeating grouped keys does), not host-only queries."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused or func.overloadpacket.__name__ in _NO_KERNEL:
            return out
        if not func.is_view or _storage(args) != _storage(out):
            self.ops += 1
        return out


def _storage(tree: Any) -> int | None:
    """The storage address of the first tensor in ``tree`` (None: no tensor)."""
    first = next((t for t in pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)), None)
    return None if first is None else first.untyped_storage().data_ptr()


@contextmanager
def counting() -> Iterator[_Count]:
    """Count operations; a replay of a layer graph counts as one launch."""
    mode = _Count()
    replay = graphs._Eager.replay

    def one_launch(self: graphs._Eager) -> None:
        mode.ops += 1
        mode.paused = True
        try:
            replay(self)
        finally:
            mode.paused = False

    with mock.patch.object(graphs._Eager, "replay", one_launch), mode:
        yield mode


def _model(family: str) -> ModelAdapter:
    conftest = importlib.import_module("tests.conftest")  # the tests' tiny random models
    tok = conftest.make_tokenizer()
    a = load_model((conftest.make_model(family, len(tok)), tok), device="cpu", dtype=torch.float32)
    a.scattered = lambda query_pos: PLAIN  # type: ignore[method-assign]  # torch's attention, as on a GPU
    return a


def _per_layer(a: ModelAdapter, setting: str, run: Callable[[], object]) -> float:
    with mock.patch.dict(os.environ, {"RAGKV_PROBE_GRAPHS": setting, "RAGKV_RECOMPUTE_GRAPHS": setting}):
        run()  # captures the bucket (not counted)
        with counting() as mode:
            run()
    return mode.ops / a.spec.num_layers


def measure(family: str, rows: int, context: int) -> dict[str, float]:
    """Kernels per layer, eager and replayed, for the probe and the recompute."""
    a = _model(family)
    s = a.spec
    g = torch.Generator().manual_seed(0)
    shape = (s.num_layers, s.num_kv_heads, context + rows, s.head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    question = torch.randint(0, 200, (rows,), generator=g)
    slots = torch.arange(4, context)
    pos = torch.randperm(context, generator=g)[:rows].sort().values
    hidden = torch.randn(1, rows, a.model.config.hidden_size, generator=g)

    def probe() -> object:
        with torch.inference_mode():
            return _question_attention(a, keys, values, question, context, slots)

    def recompute() -> object:
        cache = a.scatter_cache(keys, values)
        with torch.inference_mode():
            step = _Step.at(a, pos, context + rows, hidden)
            h = hidden
            for layer in range(s.num_layers):
                h = _run_layer(a, layer, h, step, cache)
        return h

    return {
        "probe_eager": _per_layer(a, "0", probe),
        "probe_replayed": _per_layer(a, "eager", probe),
        "recompute_eager": _per_layer(a, "0", recompute),
        "recompute_replayed": _per_layer(a, "eager", recompute),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--family", default="llama", help="llama, mistral, qwen2 or qwen3 (default llama)")
    ap.add_argument("--rows", type=int, default=32, help="rows through each layer (default 32)")
    ap.add_argument("--context", type=int, default=512, help="slots of the fused buffer (default 512)")
    args = ap.parse_args(argv)
    got = measure(args.family, args.rows, args.context)
    print(f"kernels per decoder layer ({args.family}, {args.rows} rows):")
    print("| pass | model's layers | replayed layers |\n|---|--:|--:|")
    for name in ("probe", "recompute"):
        print(f"| {name} | {got[name + '_eager']:.1f} | {got[name + '_replayed']:.1f} |")


if __name__ == "__main__":
    main()
