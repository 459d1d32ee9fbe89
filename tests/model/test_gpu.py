"""The CUDA path: exactness of re-rotation and fusion on the device, in fp32 and bf16 (skipped without CUDA).

Tolerances: fp32 as on the CPU; bf16 relative to the largest entry, since two bf16 runs of one
sequence at other positions already differ by bf16 rounding (about 2^-8 per op, compounded).
"""

from __future__ import annotations

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from tests.conftest import make_model
from tests.model.test_families import _ids, _shifted_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_REL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= _REL[dtype], f"relative error {float(err):.2e} > {_REL[dtype]:.0e} in {dtype}"


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_adapter(request, tiny_tokenizer) -> ModelAdapter:
    return load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype=request.param)


def test_rerotation_on_the_device_equals_computing_at_the_target(cuda_adapter):
    a = cuda_adapter
    ids = _ids(40, 1)
    moved = a.rerotate(_shifted_kv(a, ids, 3), 700)
    assert moved.keys.is_cuda
    _close(moved.keys, _shifted_kv(a, ids, 700).keys, a.dtype)


def test_full_recomputation_on_the_device_equals_full_prefill(cuda_adapter):
    a = cuda_adapter
    prefix, chunk_ids, suffix = _ids(9, 2), [_ids(60, 3), _ids(80, 4), _ids(70, 5)], _ids(6, 6)
    pre = a.prefill_kv(prefix)
    inp = FusionInput(pre, [a.prefill_kv(c, past=[pre]) for c in chunk_ids], chunk_ids, suffix)
    fused = fuse(a, inp, FusionConfig(method="full"))
    got = a.forward(suffix, fused.cache, fused.num_tokens)
    ref = a.forward(prefix + sum(chunk_ids, []) + suffix, a.build_cache([]), 0)[-len(suffix) :]
    assert got.is_cuda
    _close(got, ref, a.dtype)


def test_the_cpu_and_the_device_agree_in_fp32(tiny_tokenizer):
    cpu = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer)
    gpu = load_model((make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer), device="cuda", dtype="float32")
    ids = _ids(50, 7)
    _close(
        gpu.rerotate(_shifted_kv(gpu, ids, 0), 300).keys.cpu(),
        cpu.rerotate(_shifted_kv(cpu, ids, 0), 300).keys,
        torch.float32,
    )


# ---- fusion on the device against the CPU, syncs, the engine ----------------------------------


def _prompt(adapter: ModelAdapter) -> tuple[list[int], list[list[int]], list[int], FusionInput]:
    prefix, chunk_ids, suffix = _ids(9, 2), [_ids(60, 3), _ids(80, 4), _ids(70, 5)], _ids(6, 6)
    pre = adapter.prefill_kv(prefix)
    return (
        prefix,
        chunk_ids,
        suffix,
        FusionInput(pre, [adapter.prefill_kv(c, past=[pre]) for c in chunk_ids], chunk_ids, suffix),
    )


@pytest.mark.parametrize("graphs", ["0", "auto"])
@pytest.mark.parametrize("method", ["full", "naive", "blend", "query_focus"])
def test_a_fused_answer_on_the_device_equals_the_cpu_one(tiny_tokenizer, cuda_adapter, method, graphs, monkeypatch):
    """Suffix logits of a fused prompt: fp32 within 1e-4, bf16 within 4e-2 of the CPU fp32 (relative to the max);
    through the model's layers and through their CUDA graphs (``ragkv.gpu.graphs``)."""
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", graphs)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", graphs)
    cpu = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer)
    config = FusionConfig(method=method, ratio=0.3)
    *_, cpu_inp = _prompt(cpu)
    *_, gpu_inp = _prompt(cuda_adapter)
    want = fuse(cpu, cpu_inp, config, prefill_suffix=True)
    got = fuse(cuda_adapter, gpu_inp, config, prefill_suffix=True)
    assert got.suffix_logits is not None and want.suffix_logits is not None and got.suffix_logits.is_cuda
    if cuda_adapter.dtype == torch.float32:  # bf16 rounding may move a token across the selection cut
        assert torch.equal(got.selected.cpu(), want.selected)
    _close(got.suffix_logits.cpu(), want.suffix_logits, cuda_adapter.dtype)


@pytest.mark.parametrize("graphs", ["0", "auto"])
def test_the_layer_loop_never_waits_for_the_device(cuda_adapter, monkeypatch, graphs):
    """torch's sync debug mode warns at every synchronizing call: none between the first and last
    layer, through the model's layers and through the replayed ones (captured by a first fusion)."""
    import warnings

    import ragkv.fusion

    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", graphs)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", graphs)
    *_, inp = _prompt(cuda_adapter)
    fuse(cuda_adapter, inp, FusionConfig(method="full", ratio=1.0), prefill_suffix=True)  # captures the graphs
    events: list[str] = []
    run_layer = ragkv.fusion._run_layer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def synced() -> int:  # torch: "called a synchronizing CUDA operation"
            return sum("synchroniz" in str(w.message) for w in caught)

        def marked(*args, **kwargs):
            events.extend(["sync"] * (synced() - events.count("sync")))
            events.append("layer")
            return run_layer(*args, **kwargs)

        monkeypatch.setattr(ragkv.fusion, "_run_layer", marked)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fuse(cuda_adapter, inp, FusionConfig(method="full", ratio=1.0), prefill_suffix=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    layers = cuda_adapter.spec.num_layers
    assert events[events.index("layer") :] == ["layer"] * layers, [str(w.message) for w in caught]


def test_the_engine_answers_on_the_device(tmp_path, cuda_adapter):
    """Index, reuse and answer with the model on CUDA: chunk caches decode to it, reuse with full fusion is exact."""
    from tests.core.test_engine import DOCS, GEN, _engine

    with _engine(tmp_path, cuda_adapter, fusion=FusionConfig(method="full")) as rag:
        rag.index(DOCS, progress=False)
        chunks = rag.retrieve("boats and sails")
        loaded = rag.retriever.loader.load(chunks[0].token_ids)
        assert loaded.kv.keys.is_cuda and loaded.kv.keys.dtype == cuda_adapter.dtype
        reuse = rag.answer("What do sails do?", chunks=chunks, generation=GEN)
        assert reuse.stats.cache_hits == len(chunks) and reuse.stats.bytes_loaded > 0
        if cuda_adapter.dtype == torch.float32:  # bf16 greedy text may part at a near-tie
            full = rag.answer("What do sails do?", chunks=chunks, mode="full", generation=GEN)
            assert reuse.text == full.text
