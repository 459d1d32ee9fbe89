"""Fusion's layer loop reads nothing back from the device: its host syncs do not grow with the layers.

On a GPU every call counted here waits for the device (a value read back, or an output whose size
depends on the data). Counted on the CPU by wrapping them while :func:`fuse` runs on tiny models of
3, 5 and 7 layers with the same check layers: a sync inside the per-layer path would add one per
layer. The GPU test (tests/model/test_gpu.py) checks the same with torch's sync debug mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.selection import BlendParams, QueryFocusParams
from tests.conftest import make_model

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero")
_FUNCTIONS = ("nonzero", "unique", "equal", "masked_select")


@contextmanager
def counting_syncs() -> Iterator[Counter[str]]:
    """Within the block, count calls of every tensor method and torch function that syncs on a GPU."""
    counts: Counter[str] = Counter()

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    with pytest.MonkeyPatch.context() as mp:
        for name in _METHODS:
            mp.setattr(torch.Tensor, name, wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in _FUNCTIONS:
            mp.setattr(torch, name, wrap(f"torch.{name}", getattr(torch, name)))
        yield counts


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (n,), generator=g).tolist()


_LAYERS = (3, 5, 7)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> dict[int, tuple[ModelAdapter, FusionInput]]:
    """One tiny Llama per layer count, with one prompt's fusion input."""
    out = {}
    for layers in _LAYERS:
        adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer), num_hidden_layers=layers), tiny_tokenizer)
        prefix, chunks, suffix = _ids(7, 1), [_ids(30, 2), _ids(25, 3), _ids(40, 4)], _ids(6, 5)
        pre = adapter.prefill_kv(prefix)
        out[layers] = adapter, FusionInput(pre, [adapter.prefill_kv(c, past=[pre]) for c in chunks], chunks, suffix)
    return out


@pytest.mark.parametrize(
    "config",
    [
        FusionConfig(method="full", ratio=1.0),
        FusionConfig(method="blend", ratio=0.2, params=BlendParams(check_layer=1)),
        FusionConfig(method="query_focus", ratio=0.2, params=QueryFocusParams(check_layer=1, narrow_layer=2)),
    ],
    ids=["full", "blend", "query_focus"],
)
@pytest.mark.parametrize("prefill_suffix", [False, True], ids=["fuse", "fuse+suffix"])
def test_host_syncs_do_not_grow_with_the_layers(prompts, config: FusionConfig, prefill_suffix: bool) -> None:
    counts = []
    for layers in _LAYERS:
        adapter, inp = prompts[layers]
        with counting_syncs() as synced:
            fuse(adapter, inp, config, prefill_suffix=prefill_suffix)
        counts.append(synced)
    assert counts[0] == counts[1] == counts[2], counts


def test_nothing_is_read_back_between_the_first_and_the_last_layer(prompts, monkeypatch) -> None:
    """Without check layers there is nothing to decide: the layer loop runs through with no sync at all."""
    adapter, inp = prompts[7]
    events: list[str] = []  # "layer" per layer run, "sync" where syncs happened since the last mark
    run_layer = adapter.run_layer
    with counting_syncs() as synced:
        seen = 0

        def marked(*args: Any, **kwargs: Any) -> torch.Tensor:
            nonlocal seen
            if synced.total() != seen:
                events.append("sync")
                seen = synced.total()
            events.append("layer")
            return run_layer(*args, **kwargs)

        monkeypatch.setattr(adapter, "run_layer", marked)
        fuse(adapter, inp, FusionConfig(method="full", ratio=1.0), prefill_suffix=True)
    assert events[events.index("layer") :] == ["layer"] * 7, events
