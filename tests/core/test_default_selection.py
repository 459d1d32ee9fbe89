"""The default selection (``query_focus``) picks exactly the tokens it picked before selection.py was
flattened: token indices captured from the previous code (commit 2d2d490, six-level inheritance)
on the tiny models end to end, and in a model-free drive over made-up deviations and attention.

The data file was written by running, on that commit, the same loops as below with the old
``ragkv.selection`` and saving ``fused.selected`` / each check's active set as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter
from ragkv.model.attention import PLAIN
from ragkv.selection import QueryFocusParams, SelectionState, Strategy
from tests.core.test_model import _ids

EXPECTED = json.loads((Path(__file__).parent / "data" / "query_focus_selected.json").read_text())


@pytest.fixture(autouse=True)
def _torchs_attention(monkeypatch):
    """The captured selections came from torch's SDPA. On the prompt of one chunk every deviation is
    rounding noise (that chunk's cache is exact), so ragkv's native kernel, as exact but rounding
    elsewhere, ranks those tokens differently; its own exactness is tests/model/test_native_attention.py's."""
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)


def _config(knobs: dict) -> FusionConfig:
    knobs = dict(knobs)
    ratio = knobs.pop("ratio")
    return FusionConfig("query_focus", ratio, QueryFocusParams(**knobs) if knobs else None)


def _drive(strategy: Strategy, lengths: list[int], layers: int, seed: int) -> list[list[int]]:
    """The active set at the start and after each check layer, fusion's loop without a model."""
    g = torch.Generator().manual_seed(seed)
    state = SelectionState.start(lengths)
    state.query_attention = torch.rand(layers, state.num_chunk_tokens, generator=g)
    active = strategy.initial(state)
    steps = [active.tolist()]
    for layer in strategy.check_layers(state, layers):
        k, v = torch.rand(active.numel(), generator=g), torch.rand(active.numel(), generator=g)
        strategy.observe(state, layer, active, k, v)
        active = active[strategy.select(state, layer)]
        steps.append(active.tolist())
    return steps


def test_the_default_is_the_default():
    assert FusionConfig().method == "query_focus" and FusionConfig().ratio == 0.15
    assert FusionConfig().strategy().params == QueryFocusParams()


def test_model_free_drive_selects_what_the_old_code_did():
    for case in EXPECTED["driven"]:
        got = _drive(_config(case["config"]).strategy(), case["lengths"], case["layers"], case["seed"])
        assert got == case["steps"], case


def test_fused_selection_on_the_tiny_models_is_what_the_old_code_selected(tiny_adapter):
    family = tiny_adapter.name.removeprefix("tiny-")
    want = iter(EXPECTED["fused"][family])
    for sizes, seed in EXPECTED["prompts"]:
        chunk_ids = [_ids(n, seed + 10 + i) for i, n in enumerate(sizes)]
        pre = tiny_adapter.prefill_kv(_ids(9, seed))
        chunks = [tiny_adapter.prefill_kv(c, past=[pre]) for c in chunk_ids]
        inp = FusionInput(pre, chunks, chunk_ids, _ids(5, seed + 99))
        for knobs in EXPECTED["configs"]:
            fused = fuse(tiny_adapter, inp, _config(knobs), prefill_suffix=True)
            row = next(want)
            assert (fused.selected.tolist(), fused.recomputed_tokens) == (row["selected"], row["recomputed"]), (
                sizes,
                knobs,
            )


def test_coverage_off_selects_and_computes_exactly_as_before(llama_adapter):
    # coverage 0 (the default) is a fixed share whatever min_ratio says: the captured selections, and
    # logits equal bit for bit to the default record's
    want = iter(EXPECTED["fused"]["llama"])  # prompt by prompt, config by config
    for sizes, seed in EXPECTED["prompts"][:2]:  # two prompts: the path is the same for all
        chunk_ids = [_ids(n, seed + 10 + i) for i, n in enumerate(sizes)]
        pre = llama_adapter.prefill_kv(_ids(9, seed))
        chunks = [llama_adapter.prefill_kv(c, past=[pre]) for c in chunk_ids]
        inp = FusionInput(pre, chunks, chunk_ids, _ids(5, seed + 99))
        for knobs in EXPECTED["configs"]:
            off = _config({**knobs, "coverage": 0.0, "min_ratio": 0.5})
            fused = fuse(llama_adapter, inp, off, prefill_suffix=True)
            row = next(want)
            assert (fused.selected.tolist(), fused.recomputed_tokens) == (row["selected"], row["recomputed"])
            assert fused.wanted_share is None and not fused.selection_capped
            if knobs == {"ratio": 0.15}:
                default = fuse(llama_adapter, inp, FusionConfig(), prefill_suffix=True)
                assert default.suffix_logits is not None and fused.suffix_logits is not None
                assert torch.equal(fused.suffix_logits, default.suffix_logits)


@pytest.mark.parametrize("bad", [{"narrow_layer": -1}, {"focus_ratio": 1.5}, {"sink_tokens": -1}])
def test_query_focus_params_refuse_bad_knobs(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        QueryFocusParams(**bad)
