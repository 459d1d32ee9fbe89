"""ragkv.model.masks: a fused pass's causal mask, made only where a call needs it, by blocks of rows
where it would be large; the blocked attention equals the whole mask's (on the CPU here, on CUDA
under ``-m gpu``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.gpu import graphs
from ragkv.model import ModelAdapter, load_model
from ragkv.model.attention import PLAIN
from ragkv.model.masks import PositionMask, causal_mask_at
from ragkv.model.native_attention import attention_available
from tests.conftest import make_model
from tests.gpu.graph_safety import strict_eager

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])]


@pytest.mark.parametrize("sort", [True, False])
def test_each_block_is_the_whole_mask_cut_after_its_last_row(sort):
    g = torch.Generator().manual_seed(1)
    pos = torch.randperm(300, generator=g)[:90]
    pos = pos.sort().values if sort else pos
    whole = causal_mask_at(pos, 300, torch.float32, torch.device("cpu"))
    mask = PositionMask(pos, 300, torch.float32, torch.device("cpu"), block_bytes=32 * 304 * 4)
    assert mask.blocked and mask.nbytes == 90 * 304 * 4
    covered = 0
    for start, end, cut, block in mask.blocks():
        assert end - start <= 32 and cut == int(pos[start:end].max()) + 1
        assert torch.equal(block, whole[:, :, start:end, :cut])
        assert bool((whole[:, :, start:end, cut:] == torch.finfo(torch.float32).min).all())  # only masked slots cut
        assert all(s % 16 == 0 for s in block.stride()[:-1])  # rows padded as the whole mask's
        covered += end - start
    assert covered == 90
    assert torch.equal(mask.dense(), whole) and mask.dense() is mask.dense()  # made once
    with pytest.raises(ValueError, match="1-D host tensor"):
        PositionMask(pos.reshape(9, 10), 300, torch.float32, torch.device("cpu"))


@contextmanager
def recorded_masks() -> Iterator[list[torch.Tensor]]:
    """The masks fusion's passes make within the block: whole ones and blocks'."""
    masks: list[torch.Tensor] = []
    dense, blocks = PositionMask.dense, PositionMask.blocks

    def recorded_dense(self: PositionMask) -> torch.Tensor:
        masks.append(dense(self))
        return masks[-1]

    def recorded_blocks(self: PositionMask) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        for start, end, cut, block in blocks(self):
            masks.append(block)
            yield start, end, cut, block

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PositionMask, "dense", recorded_dense)
        mp.setattr(PositionMask, "blocks", recorded_blocks)
        yield masks


def _request(a: ModelAdapter, seed: int = 4) -> FusionInput:
    g = torch.Generator().manual_seed(seed)
    prefix = a.prefill_kv(torch.randint(0, 200, (6,), generator=g).tolist())
    chunk_ids = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (120, 90, 150)]
    chunks = [a.prefill_kv(c, past=[prefix]) for c in chunk_ids]
    return FusionInput(prefix, chunks, chunk_ids, torch.randint(0, 200, (9,), generator=g).tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "impl", "replay"),
    [
        (torch.float32, "sdpa", "0"),
        (torch.bfloat16, "sdpa", "0"),
        (torch.float32, "eager", "0"),
        (torch.float32, "sdpa", "graphs"),  # the recompute's layers replayed, the attention between them
    ],
)
def test_a_fusion_by_blocks_of_rows_equals_the_one_with_the_whole_mask(
    tiny_tokenizer, monkeypatch, device, dtype, impl, replay
):
    """torch's attention (the GPU's path; ragkv's CPU kernel switched off), SDPA or the modeling file's
    eager one, in the model's layers or between replayed ones: the same tokens selected, the fused
    cache and the logits within rounding, with every mask a block's."""
    model = make_model("llama", len(tiny_tokenizer), attn_implementation=impl)
    a = load_model((model, tiny_tokenizer), device=device, dtype=dtype)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "0")
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "0")
    inp, config = _request(a), FusionConfig(ratio=0.3)
    with recorded_masks() as whole_masks:
        want = fuse(a, inp, config, prefill_suffix=True)
    if replay == "graphs":
        monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager" if device == "cpu" else "auto")
        monkeypatch.setattr(graphs, "_eager", strict_eager)
        monkeypatch.setattr(graphs, "_MODELS", graphs.weakref.WeakKeyDictionary())
    monkeypatch.setattr("ragkv.model.masks.MASK_BLOCK_BYTES", 16 * 400 * dtype.itemsize)  # 16-32 rows a block
    made = []
    init = PositionMask.__init__
    monkeypatch.setattr(PositionMask, "__init__", lambda self, *a, **k: made.append(init(self, *a, **k)))
    with recorded_masks() as block_masks:
        got = fuse(a, inp, config, prefill_suffix=True)
    assert made and all(m.shape[-1] == want.num_tokens + 9 for m in whole_masks)  # every slot, the question's too
    assert len(block_masks) > 2 * len(whole_masks)
    assert all(m.shape[2] <= 32 for m in block_masks) and min(m.shape[-1] for m in block_masks) < want.num_tokens
    if replay == "graphs":
        assert graphs._MODELS[a.model].buckets  # the layers did replay
    if dtype == torch.bfloat16 and device == "cuda" and not torch.equal(want.selected, got.selected):
        # bf16 on CUDA: kernels over fewer keys may round a deviation at a near-tie the other way
        shared = set(want.selected.tolist()) & set(got.selected.tolist())
        assert len(shared) >= 0.9 * len(want.selected)
        return
    assert torch.equal(want.selected, got.selected)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.suffix_logits, want.suffix_logits, **tol)
    for layer in range(a.spec.num_layers):
        w, o = want.cache.layers[layer], got.cache.layers[layer]
        torch.testing.assert_close(o.keys, w.keys, **tol)
        torch.testing.assert_close(o.values, w.values, **tol)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_blocks_of_one_row_and_grouped_heads_equal_the_whole_mask(tiny_tokenizer, impl):
    """The dispatcher alone, 6 query heads over 2 KV heads, 33 rows in blocks of 16 (the last of one row)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = make_model(
        "llama", len(tiny_tokenizer), attn_implementation=impl, num_attention_heads=6, hidden_size=96, head_dim=16
    )
    a = load_model((model, tiny_tokenizer), dtype=torch.float32)
    attend = ALL_ATTENTION_FUNCTIONS[a.model.config._attn_implementation]
    module = a.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    pos = torch.randperm(200, generator=g)[:33].sort().values
    q, k, v = (
        torch.randn(1, 6, 33, 16, generator=g),
        torch.randn(1, 2, 200, 16, generator=g),
        torch.randn(1, 2, 200, 16, generator=g),
    )
    whole = PositionMask(pos, 200, torch.float32, torch.device("cpu"))
    blocked = PositionMask(pos, 200, torch.float32, torch.device("cpu"), block_bytes=16 * 208 * 4)
    assert [e - s for s, e, _ in blocked.spans()] == [16, 16, 1]
    want, _ = attend(module, q, k, v, whole, dropout=0.0, scaling=0.25)
    got, _ = attend(module, q, k, v, blocked, dropout=0.0, scaling=0.25)
    assert got.shape == want.shape == (1, 33, 6, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blocked", [True, False], ids=["blocks", "whole"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_heads_share_their_key_heads_where_a_fused_kernel_takes_them_else_repeat_them_once(
    tiny_tokenizer, monkeypatch, device, dtype, blocked
):
    """The query heads of a group read their key and value head as it is (``enable_gqa``) where torch
    picks a fused kernel for that; else the keys and values are repeated, once for all blocks. The
    two agree (bit for bit on the CPU, whose flash kernel takes both), no repeat is made on the
    shared path, and a mask small enough to make whole (one block) gives transformers' SDPA call's
    output, which repeats them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ragkv.model import attention as attention_module

    model = make_model(
        "llama", len(tiny_tokenizer), attn_implementation="sdpa", num_attention_heads=6, hidden_size=96, head_dim=16
    )
    a = load_model((model, tiny_tokenizer), device=device, dtype=dtype)
    attend = ALL_ATTENTION_FUNCTIONS[a.model.config._attn_implementation]
    module = a.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    pos = torch.randperm(200, generator=g)[:33].sort().values
    q, k, v = (torch.randn(1, h, n, 16, generator=g).to(device, dtype) for h, n in ((6, 33), (2, 200), (2, 200)))
    calls: list[dict] = []
    repeats: list[int] = []
    sdpa, repeat = attention_module.F.scaled_dot_product_attention, attention_module.repeat_kv
    monkeypatch.setattr(
        attention_module.F, "scaled_dot_product_attention", lambda *x, **kw: calls.append(kw) or sdpa(*x, **kw)
    )
    monkeypatch.setattr(attention_module, "repeat_kv", lambda t, n: repeats.append(n) or repeat(t, n))

    def mask() -> PositionMask:
        block_bytes = 16 * 208 * dtype.itemsize if blocked else None  # 3 blocks, or the whole mask
        return PositionMask(pos, 200, dtype, torch.device(device), block_bytes=block_bytes)

    def run(shared: bool | None) -> torch.Tensor:
        calls.clear()
        repeats.clear()
        if shared is not None:
            monkeypatch.setattr(attention_module, "_shares_heads", lambda *x: shared)
        return attend(module, q, k, v, mask(), dropout=0.0, scaling=0.25)[0]

    blocks = 3 if blocked else 1
    if device == "cpu":  # torch's flash kernel takes a masked grouped call on the CPU
        run(None)
        assert len(calls) == blocks and all(kw.get("enable_gqa") for kw in calls) and not repeats
    shared, apart = run(True), run(False)
    assert len(calls) == blocks and not any(kw.get("enable_gqa") for kw in calls) and repeats == [3, 3]  # once
    if device == "cpu":
        assert torch.equal(shared, apart)
    else:
        torch.testing.assert_close(shared, apart, rtol=2e-2, atol=2e-2)
    if not blocked:  # what the model's own SDPA function gives for the whole mask
        want, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask().dense(), dropout=0.0, scaling=0.25)
        assert torch.equal(apart, want)


def test_one_grouped_row_with_a_whole_mask_stays_with_transformers(tiny_tokenizer, monkeypatch):
    """transformers packs one row's grouped query heads into their key heads itself (no copy): such a
    call is not taken into ragkv's own SDPA call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ragkv.model import attention as attention_module

    model = make_model(
        "llama", len(tiny_tokenizer), attn_implementation="sdpa", num_attention_heads=6, hidden_size=96, head_dim=16
    )
    a = load_model((model, tiny_tokenizer), dtype=torch.float32)
    module = a.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((6, 1), (2, 50), (2, 50)))
    taken: list[int] = []
    own = attention_module._blocked_attention
    monkeypatch.setattr(attention_module, "_blocked_attention", lambda *x, **kw: taken.append(1) or own(*x, **kw))
    mask = PositionMask(torch.tensor([40]), 50, torch.float32, torch.device("cpu"))
    got, _ = ALL_ATTENTION_FUNCTIONS[a.model.config._attn_implementation](
        module, q, k, v, mask, dropout=0.0, scaling=0.25
    )
    want, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask.dense(), dropout=0.0, scaling=0.25)
    assert not taken and torch.equal(got, want)


@pytest.mark.skipif(not attention_available(torch.float32), reason="ragkv's CPU kernel does not run here")
def test_on_ragkvs_cpu_kernel_a_fusion_makes_no_mask(tiny_tokenizer, monkeypatch):
    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), dtype=torch.float32)
    made: list[str] = []
    init = PositionMask.__init__
    monkeypatch.setattr(PositionMask, "__init__", lambda self, *a, **k: made.append(init(self, *a, **k) or "mask"))
    monkeypatch.setattr(PositionMask, "dense", lambda self: made.append("dense"))
    monkeypatch.setattr(PositionMask, "blocks", lambda self: made.append("blocks"))
    fused = fuse(a, _request(a), FusionConfig(ratio=0.3), prefill_suffix=True)
    assert fused.recomputed_tokens > 0 and made and set(made) == {"mask"}  # made, never made into a tensor
