"""Calibrate a model's channel transform (:mod:`ragkv.codec.transform`) from chunks of its KV.

Once per model fingerprint, at index time: the basis per (K/V, layer, KV head) is the
eigenvectors of the channel covariance of the calibration chunks (keys rotated back to position
0 first). Each (K/V, layer) then keeps the basis only where it pays: coded as ``cachegen`` codes
it at a reference level, with and without the basis, the bytes are compared at equal squared
error (at the rates these levels run at, a uniform quantizer's bytes change by about half a bit
per element per halving of its squared error, so a layer whose error the basis lowers is
credited that many bytes). Layers whose saving is under ``min_saving`` stay in the model's
channels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ragkv.codec import cachegen
from ragkv.codec.transform import ChannelTransform
from ragkv.types import ChunkKV

__all__ = ["calibrate", "layer_savings", "step_scales"]


def calibrate(
    slices: Sequence[ChunkKV], *, inv_freq: Sequence[float] = (), level: int = 1, min_saving: float = 0.03
) -> ChannelTransform:
    """A channel transform for the model that computed ``slices``.

    Args:
        slices: chunks of the model's KV (at least 2 tokens each counts; the first token of each
            is left out, as ``cachegen`` stores it apart).
        inv_freq: the model's RoPE pair frequencies (``r`` values rotating dims ``i`` and ``i + r``);
            empty: keys are taken as they are.
        level: the ``cachegen`` level whose steps judge where the basis pays.
        min_saving: the share of a layer's bytes the basis must save (at equal error) to be used.

    Raises:
        ValueError: no chunk with 2+ tokens, or chunks of different models or shapes.
    """
    usable = [kv for kv in slices if kv.num_tokens >= 2]
    if not usable:
        raise ValueError("calibrate needs chunks of at least 2 tokens")
    first = usable[0]
    if any(kv.model_fingerprint != first.model_fingerprint or _shape(kv) != _shape(first) for kv in usable):
        raise ValueError("calibrate needs chunks of one model (same fingerprint and shape)")
    layers, heads, _, head_dim = first.keys.shape
    everywhere = (tuple([True] * layers), tuple([True] * layers))
    identity = torch.eye(head_dim).expand(2, layers, heads, head_dim, head_dim)
    unrotate = ChannelTransform(first.model_fingerprint, identity, everywhere, tuple(inv_freq))
    moments = torch.zeros(2, layers, heads, head_dim, head_dim, dtype=torch.float64)
    sums = torch.zeros(2, layers, heads, head_dim, 1, dtype=torch.float64)
    count = 0
    for kv in usable:
        keys, values = unrotate.forward(kv.keys, kv.values, kv.positions)
        for kind, x in enumerate((keys, values)):
            y = x[:, :, 1:].double()  # [L, H, N, D]
            moments[kind] += y.transpose(2, 3) @ y
            sums[kind] += y.sum(dim=2).unsqueeze(-1)
        count += kv.num_tokens - 1
    mean = sums / count
    cov = moments / count - mean @ mean.transpose(3, 4)
    _, vectors = torch.linalg.eigh(cov)  # ascending eigenvalues
    basis = vectors.flip(-1).float()
    candidate = ChannelTransform(first.model_fingerprint, basis, everywhere, tuple(inv_freq))
    savings = layer_savings(usable, candidate, level)
    enabled = tuple(tuple(bool(s >= min_saving) for s in row) for row in savings)
    return ChannelTransform(first.model_fingerprint, basis, (enabled[0], enabled[1]), tuple(inv_freq))


def layer_savings(slices: Sequence[ChunkKV], transform: ChannelTransform, level: int) -> list[list[float]]:
    """Per K/V and layer, the share of ``cachegen`` bytes at ``level`` the basis saves at equal squared error.

    Layers ``transform`` does not enable count as if it did (this measures the basis itself).
    """
    on = ChannelTransform(
        transform.model_fingerprint,
        transform.basis,
        (tuple([True] * transform.shape[0]), tuple([True] * transform.shape[0])),
        transform.inv_freq,
    )
    schedule = cachegen.LEVELS[level]
    layers = transform.shape[0]
    # [K/V][plain, transformed] per layer: bytes, squared error, elements
    nbytes = torch.zeros(2, 2, layers, dtype=torch.float64)
    error = torch.zeros(2, 2, layers, dtype=torch.float64)
    elements = 0
    for kv in slices:
        if kv.num_tokens < 2:
            continue
        spaces = on.forward(kv.keys, kv.values, kv.positions)
        for kind, (x, relative, per_layer) in enumerate(
            ((kv.keys, schedule.key_steps, True), (kv.values, schedule.value_steps, False))
        ):
            rel = torch.tensor([relative[schedule.group(i, layers)] for i in range(layers)]).view(-1, 1, 1, 1)
            sigma = cachegen.channel_sigma(x[:, :, 1:].float(), per_layer)
            per_head = torch.exp(torch.log(sigma).mean(dim=3, keepdim=True)).expand_as(sigma)
            for variant, (y, s) in enumerate(((x[:, :, 1:].float(), sigma), (spaces[kind][:, :, 1:], per_head))):
                code, mean, q = cachegen.quantize(y, s * rel)
                frames, _ = cachegen.code_streams(q, schedule.zstd_level)
                nbytes[kind, variant] += torch.tensor([len(f) for f in frames], dtype=torch.float64)
                step = cachegen.step_value(code).unsqueeze(2)  # [L, H, 1, D]
                y_hat = (q.float() + mean.float().unsqueeze(2)) * step
                error[kind, variant] += (y_hat - y).double().pow(2).sum(dim=(1, 2, 3))
        elements += kv.keys[0, :, 1:].numel()
    # bytes the transformed coding would take at the plain coding's error: half a bit per element
    # per halving of the squared error
    ratio = (error[:, 1] / error[:, 0].clamp_min(1e-30)).clamp_min(1e-30)
    adjusted = nbytes[:, 1] + elements * 0.5 * torch.log2(ratio) / 8
    saving = 1 - adjusted / nbytes[:, 0].clamp_min(1)
    return [[float(v) if math.isfinite(float(v)) else 0.0 for v in row] for row in saving]


def step_scales(kl: Sequence[Sequence[float]], limit: float = 4.0) -> tuple[tuple[float, ...], ...]:
    """Per K/V and layer step multipliers from each layer's measured sensitivity.

    ``kl[kind][layer]`` is the KL a layer's keys (0) or values (1) cause alone when perturbed
    by noise proportional to the level's own step there. With KL about ``s_l * step_l**2`` and
    bytes about ``-log2(step_l)`` per element, total KL at fixed bytes is least when every layer
    pays the same KL per bit: ``step_l`` proportional to ``kl_l ** -0.5``. The multipliers have
    geometric mean 1 (bytes about unchanged) and are clamped to ``[1/limit, limit]``.

    >>> step_scales([[0.04, 0.01], [0.01, 0.01]])
    ((0.5946..., 1.1892...), (1.1892..., 1.1892...))
    """
    values = torch.tensor([list(row) for row in kl], dtype=torch.float64)
    if values.dim() != 2 or values.shape[0] != 2 or not bool(torch.isfinite(values).all()):
        raise ValueError("step_scales needs two rows (keys, values) of finite per-layer KL")
    values = values.clamp_min(max(float(values.max()), 1e-12) * 1e-4)  # a layer at zero KL: the clamp decides
    log_m = -0.5 * torch.log(values)
    m = torch.exp(log_m - log_m.mean()).clamp(1 / limit, limit)
    return tuple(tuple(float(v) for v in row) for row in m)


def _shape(kv: ChunkKV) -> tuple[int, int, int]:
    return (kv.num_layers, kv.num_kv_heads, kv.head_dim)
