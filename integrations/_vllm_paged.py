"""vLLM's paged KV cache, written and read back with vLLM's own cache op.

Writing uses the backend's op (``cpu_attn_reshape_and_cache`` on CPU, ``reshape_and_cache_flash``
on GPU), so the bytes are laid out exactly as vLLM's forward writes them. vLLM has no op for the
way back, and the layout inside a block depends on the backend and the CPU's ISA (the CPU op
stores K transposed per block for AVX-512, V not; AMX tiles differ again). So reading is a gather
through a map *measured* with the write op itself: a one-block probe cache is written with tokens,
heads and dims as values, and where each value lands is where that (token, head, dim) lives in
every block. One probe per layout; no layout is written down here, so none can drift from vLLM's.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["read_paged", "write_paged"]

_MAPS: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_MAPS_LOCK = threading.Lock()


def write_paged(
    keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, isa: str | None, kv_dtype: str
) -> None:
    """Write ``keys``/``values`` ``[tokens, kv_heads, head_dim]`` into one layer's paged ``cache`` at ``slots``.

    The layer's cache is ``[blocks, kv_heads, block_size, 2 * head_dim]`` for vLLM 0.32's CPU and
    FlashAttention backends alike; each backend's own write op lays K and V out inside it (the CPU
    op stores K transposed per block), so the bytes are those vLLM's forward would write.
    """
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    num_blocks, heads, block_size, fused = cache.shape
    head_dim = fused // 2
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        key_cache, value_cache = cache.view(num_blocks, heads, block_size * 2, head_dim).chunk(2, dim=2)
        isa = isa or _get_attn_isa(cache.dtype, block_size, head_dim, kv_dtype)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_dtype)
        return
    # not run here (no GPU in CI): the FlashAttention backend's own view and op
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    one = torch.ones((), dtype=torch.float32, device=cache.device)
    ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, kv_dtype, one, one)


def block_maps(cache: torch.Tensor, isa: str | None, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, head, dim) of K and of V lives inside one block of a cache shaped like ``cache``.

    Returns:
        ``(k_map, v_map)``, each ``[block_size, kv_heads, head_dim]`` int64 offsets into one block
        flattened (``cache.view(num_blocks, -1)[b]``), measured by writing a probe with
        :func:`write_paged` (cached per layout).
    """
    _, heads, block_size, fused = cache.shape
    head_dim = fused // 2
    layout = (tuple(cache.shape[1:]), cache.dtype, cache.device, isa, kv_dtype)
    with _MAPS_LOCK:
        got = _MAPS.get(layout)
    if got is not None:
        return got
    if max(block_size, heads, head_dim) > 256:  # probe values must be exact in bf16 (8 mantissa bits)
        raise ValueError(f"cannot probe a paged layout with more than 256 tokens, heads or dims: {tuple(cache.shape)}")
    shape = (block_size, heads, head_dim)

    def axis(dim: int) -> torch.Tensor:  # [block_size, heads, head_dim] holding its index along ``dim``
        view = [1, 1, 1]
        view[dim] = shape[dim]
        return torch.arange(shape[dim], device=cache.device).view(view).expand(shape).to(cache.dtype).contiguous()

    slots = torch.arange(block_size, device=cache.device)
    zeros, ones = torch.zeros(shape, dtype=cache.dtype, device=cache.device), None
    ones = torch.ones_like(zeros)
    written = []
    for k, v in ((zeros, ones), (axis(0), axis(0)), (axis(1), axis(1)), (axis(2), axis(2))):
        probe = torch.full((1, *cache.shape[1:]), -1.0, dtype=cache.dtype, device=cache.device)
        write_paged(k, v, probe, slots, isa, kv_dtype)
        written.append(probe.reshape(-1).long())
    which, tok, head, dim = written
    maps = []
    for half in (0, 1):  # 0: K, 1: V
        offsets = torch.nonzero(which == half).squeeze(1)
        flat = (tok[offsets] * heads + head[offsets]) * head_dim + dim[offsets]
        gather = torch.full((block_size * heads * head_dim,), -1, dtype=torch.long, device=cache.device)
        gather[flat] = offsets
        if offsets.numel() != gather.numel() or bool((gather < 0).any()):
            raise ValueError(f"vLLM's cache op did not write one value per (token, head, dim) for {tuple(cache.shape)}")
        maps.append(gather.view(shape))
    got = (maps[0], maps[1])
    with _MAPS_LOCK:
        _MAPS[layout] = got
    return got


def read_paged(
    cache: torch.Tensor, slots: torch.Tensor, isa: str | None, kv_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V at ``slots`` of one layer's paged ``cache``: ``[tokens, kv_heads, head_dim]`` each.

    The inverse of :func:`write_paged` (a round trip returns the values written, bit for bit).
    """
    k_map, v_map = block_maps(cache, isa, kv_dtype)
    block_size = cache.shape[2]
    flat = cache.view(cache.shape[0], -1)  # one row per block (vLLM's per-layer caches are contiguous)
    blocks = (slots // block_size).view(-1, 1, 1)
    within = slots % block_size
    return flat[blocks, k_map[within]], flat[blocks, v_map[within]]
