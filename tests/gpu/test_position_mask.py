"""ragkv.model.masks: a fused pass's causal mask, made only where a call needs it, by blocks of rows
where it would be large; the blocked attention equals the whole mask's (on the CPU here, on CUDA
under ``-m gpu``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from ragkv.fusion import FusionConfig, FusionInput, fuse
from ragkv.model import ModelAdapter, load_model
from ragkv.model.attention import PLAIN
from ragkv.model.masks import PositionMask, causal_mask_at
from ragkv.model.native_attention import attention_available
from tests.conftest import make_model
from tests.core.test_masks import recorded_masks as recorded_sdpa_masks

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
def recorded_masks(impl: str) -> Iterator[list[Any]]:
    """The masks the layers' ``impl`` attention receives (tests/core/test_masks.py's, for either implementation)."""
    if impl == "sdpa":
        with recorded_sdpa_masks() as masks:
            yield masks
        return
    import transformers.models.llama.modeling_llama as llama

    masks: list[Any] = []
    eager = llama.eager_attention_forward

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, *a, **kw):
        masks.append(mask)
        return eager(module, query, key, value, mask, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "eager_attention_forward", recording)
        mp.setattr("ragkv.model.attention._EAGER", {})
        yield masks


def _request(a: ModelAdapter, seed: int = 4) -> FusionInput:
    g = torch.Generator().manual_seed(seed)
    prefix = a.prefill_kv(torch.randint(0, 200, (6,), generator=g).tolist())
    chunk_ids = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (120, 90, 150)]
    chunks = [a.prefill_kv(c, past=[prefix]) for c in chunk_ids]
    return FusionInput(prefix, chunks, chunk_ids, torch.randint(0, 200, (9,), generator=g).tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "impl"), [(torch.float32, "sdpa"), (torch.bfloat16, "sdpa"), (torch.float32, "eager")]
)
def test_a_fusion_by_blocks_of_rows_equals_the_one_with_the_whole_mask(
    tiny_tokenizer, monkeypatch, device, dtype, impl
):
    """torch's attention (the GPU's path; ragkv's CPU kernel switched off), SDPA or the modeling file's
    eager one: the same tokens selected, the fused cache and the logits within rounding, with every
    mask a block's."""
    model = make_model("llama", len(tiny_tokenizer), attn_implementation=impl)
    a = load_model((model, tiny_tokenizer), device=device, dtype=dtype)
    monkeypatch.setattr(ModelAdapter, "scattered", lambda self, pos: PLAIN)
    monkeypatch.setenv("RAGKV_PROBE_GRAPHS", "0")
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "0")
    inp, config = _request(a), FusionConfig(ratio=0.3)
    with recorded_masks(impl) as whole_masks:
        want = fuse(a, inp, config, prefill_suffix=True)
    monkeypatch.setattr("ragkv.model.masks.MASK_BLOCK_BYTES", 16 * 400 * dtype.itemsize)  # 16-32 rows a block
    with recorded_masks(impl) as block_masks:
        got = fuse(a, inp, config, prefill_suffix=True)
    assert all(m.shape[-1] == want.num_tokens + 9 for m in whole_masks)  # every slot, the question's too
    assert len(block_masks) > 2 * len(whole_masks)
    assert all(m.shape[2] <= 32 for m in block_masks) and min(m.shape[-1] for m in block_masks) < want.num_tokens
    assert torch.equal(want.selected, got.selected)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.suffix_logits, want.suffix_logits, **tol)
    for layer in range(a.spec.num_layers):
        for w, o in zip(want.cache.layers[layer].keys, got.cache.layers[layer].keys, strict=True):
            torch.testing.assert_close(o, w, **tol)


@pytest.mark.skipif(not attention_available(torch.float32), reason="ragkv's CPU kernel does not run here")
def test_on_ragkvs_cpu_kernel_a_fusion_makes_no_mask(tiny_tokenizer, monkeypatch):
    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), dtype=torch.float32)
    made: list[str] = []
    monkeypatch.setattr(PositionMask, "dense", lambda self: made.append("dense"))
    monkeypatch.setattr(PositionMask, "blocks", lambda self: made.append("blocks"))
    fused = fuse(a, _request(a), FusionConfig(ratio=0.3), prefill_suffix=True)
    assert fused.recomputed_tokens > 0 and made == []
