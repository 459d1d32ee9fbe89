"""``encode`` / ``decode``: ChunkKV <-> one self-describing, checksummed bitstream bound to its storage key."""

from __future__ import annotations

import struct

import torch
import zstandard

from ragkv.codec.bitstream import FORMAT_VERSION, open_frame, pack
from ragkv.codec.header import AUTH_HMAC_SHA256, BitstreamHeader, position_runs
from ragkv.codec.payload import CodecPayload
from ragkv.codec.raw import raw_views
from ragkv.codec.registry import get_codec
from ragkv.codec.transform import ChannelTransform
from ragkv.codec.trust import Expected, check_expected, check_secret, key_namespace, mac_key
from ragkv.errors import CodecError
from ragkv.types import ChunkKV, CodecSpec, EncodedChunk, StorageKey

__all__ = ["encode", "decode"]

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
# Failures of foreign code on bytes that passed the checksum but were crafted to mislead: they
# become CodecError here, so callers only ever see ragkv's errors.
_FOREIGN_ERRORS = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    OverflowError,
    RuntimeError,
    struct.error,
    zstandard.ZstdError,
)


def encode(
    kv: ChunkKV,
    spec: CodecSpec,
    *,
    key: StorageKey,
    secret: bytes | None = None,
    saliency: torch.Tensor | None = None,
    transform: ChannelTransform | None = None,
) -> EncodedChunk:
    """Encode a chunk's KV into one bitstream, bound to the storage key it will be stored under.

    Args:
        kv: the chunk's KV, on any device, float16/bfloat16/float32/float64.
        spec: a registered codec (see :func:`available_codecs`) and one of its levels.
        key: the storage key the bytes are for (``ChunkKey.storage_key``); a reader asking for any
            other key refuses them.
        secret: when given, the bitstream ends with an HMAC-SHA256 tag keyed by this secret and
            the key's tenant namespace, so that only holders of the secret can write entries a
            reader with the secret accepts.
        saliency: optional ``[tokens]`` scores, higher for tokens that matter more (e.g. the
            normalized attention each token received in the chunk's prefill, see
            :func:`token_saliency`); codecs with salient-token levels keep the top ones at a finer
            step. Without it they derive a proxy from the keys and values themselves.
        transform: the model's channel transform (:mod:`ragkv.codec.transform`), for a codec
            that can code in it (``cachegen``); the bitstream names its digest, and decodes only
            with the same transform.

    Returns:
        The bitstream with its codec spec and token count.

    Raises:
        ValueError: unknown codec or level, a malformed key, an empty secret, an unsupported dtype,
            non-finite values, a saliency that is not one finite score per token, or a transform
            for another model or shape, or given to a codec that cannot use one.
        TypeError: ``spec`` is not a CodecSpec or ``secret`` is not bytes.
    """
    if not isinstance(spec, CodecSpec):
        raise TypeError(f"spec must be a CodecSpec, e.g. CodecSpec('cachegen', 0); got {spec!r}")
    impl = get_codec(spec.name)
    if spec.level not in impl.levels:
        raise ValueError(f"codec {spec.name!r} has levels {impl.levels}; got {spec.level!r}")
    key_namespace(key)
    check_secret(secret)
    source_dtype = _DTYPE_NAMES.get(kv.keys.dtype)
    if source_dtype is None or kv.values.dtype != kv.keys.dtype:
        raise ValueError(
            f"KV must be float16, bfloat16, float32 or float64 (keys and values alike); got "
            f"{kv.keys.dtype} and {kv.values.dtype}"
        )
    keys = kv.keys.detach().to("cpu").contiguous()
    values = kv.values.detach().to("cpu").contiguous()
    if not (bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())):
        raise ValueError("KV holds NaN or infinite values; refusing to encode a broken cache")
    if saliency is not None:
        saliency = saliency.detach().to("cpu", torch.float32).reshape(-1)
        if saliency.numel() != kv.num_tokens or not bool(torch.isfinite(saliency).all()):
            raise ValueError(f"saliency must hold one finite score per token ({kv.num_tokens}); got {saliency.numel()}")
    if transform is None:
        payload = impl.encode_salient(keys, values, spec.level, saliency)
    else:
        _check_transform_fits(transform, kv)
        payload = impl.encode_transformed(keys, values, spec.level, saliency, transform, kv.positions)
        payload = CodecPayload(payload.sections, {**payload.params, "transform": transform.digest})
    header = BitstreamHeader(
        format_version=FORMAT_VERSION,
        codec=spec.name,
        level=spec.level,
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        num_tokens=kv.num_tokens,
        head_dim=kv.head_dim,
        source_dtype=source_dtype,
        model_fingerprint=kv.model_fingerprint,
        position_runs=position_runs(kv.positions.tolist()),
        section_sizes=tuple(len(s) for s in payload.sections),
        params=payload.params,
        storage_key=key,
        auth=AUTH_HMAC_SHA256 if secret is not None else "",
    )
    tag_key = None if secret is None else mac_key(secret, key)
    data = pack(header, payload.sections, mac_key=tag_key)
    return EncodedChunk(spec=spec, num_tokens=kv.num_tokens, data=data)


def decode(
    data: bytes | bytearray | memoryview,
    *,
    expect: Expected | None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    transform: ChannelTransform | None = None,
    view: bool = False,
) -> ChunkKV:
    """Decode a bitstream written by :func:`encode`, if it is what ``expect`` asks for.

    Every check that needs no payload runs first, so a refused bitstream costs no allocation
    for its payload: the prelude and header (with its checksum), the total length against the
    header's section sizes, the header against ``expect`` (key, model, codec, level, every shape
    field), the authentication tag (when ``expect.secret`` is set), the codec's own section-size
    check; only then the payload checksum and the decode. Entropy decoding runs on the CPU;
    dequantization runs on ``device`` (to CUDA the integers cross from pinned memory,
    asynchronously: no host fp32 round trip, no stream sync per chunk).

    A bitstream with a tag decodes without a secret too (the tag is then unchecked extra bytes):
    a reader without the secret trusts its store anyway.

    Args:
        data: the whole bitstream.
        expect: what the caller asked for (the query path always passes one), or None, explicitly,
            to decode whatever the bytes hold (tools and benchmarks decoding their own bytes).
        device: where the returned tensors go.
        dtype: floating dtype of the returned keys and values.
        transform: the channel transform the bitstream was coded in, if its header names one
            (ignored otherwise).
        view: on the CPU, a raw payload comes back as read-only views of ``data`` in its stored
            dtype (fp16), not as copies in ``dtype``: for a caller that only reads it (staging to a
            GPU, which converts on the way). Other codecs and devices ignore it.

    Returns:
        The chunk's KV: keys/values ``[layers, kv_heads, tokens, head_dim]`` on ``device``; positions
        on the host (metadata: re-rotation compares them without a device sync).

    Raises:
        IncompatibleCacheError: it was written for another key, model, codec, level or shape, or
            by a newer ragkv.
        CodecError: the bytes are truncated, corrupted, foreign, use an unknown codec, or lack a
            valid tag that ``expect.secret`` requires, or were coded in a channel transform that
            ``transform`` is not (a miss: the caller recomputes).
        TypeError: ``dtype`` is not a floating dtype, or ``expect`` is not an Expected.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype; got {dtype!r}")
    if expect is not None and not isinstance(expect, Expected):
        raise TypeError(f"expect must be a ragkv.codec.Expected or None; got {type(expect).__name__}")
    target = torch.device(device)
    frame = open_frame(data)
    header = frame.header
    if expect is not None:
        check_expected(header, expect)
        if expect.secret is not None:
            frame.verify_tag(mac_key(expect.secret, expect.key))
    try:
        impl = get_codec(header.codec)
    except ValueError as e:
        raise CodecError(f"bitstream uses codec {header.codec!r}, unknown to this ragkv: {e}") from e
    if header.level not in impl.levels:
        raise CodecError(f"bitstream uses level {header.level} that codec {header.codec!r} lacks")
    impl.check(header)
    coded_in = _coded_in(header, transform)
    frame.verify_checksum()
    try:
        if view and target.type == "cpu" and coded_in is None and header.codec == "raw":
            keys, values = raw_views(header, frame.sections())
        else:
            keys, values = impl.decode(header, frame.sections(), target, dtype if coded_in is None else torch.float32)
    except CodecError:
        raise
    except _FOREIGN_ERRORS as e:
        raise CodecError(f"{header.codec} payload does not decode: {e}") from e
    if tuple(keys.shape) != header.shape or tuple(values.shape) != header.shape:
        raise CodecError(f"{header.codec} payload decoded to the wrong shape")
    positions = _positions(header)
    if coded_in is not None:
        coded_in.inverse_(keys, values, positions)  # the decoder's own fp32 output, in place
        keys, values = keys.to(dtype), values.to(dtype)
    return ChunkKV(keys=keys, values=values, positions=positions, model_fingerprint=header.model_fingerprint)


def _check_transform_fits(transform: ChannelTransform, kv: ChunkKV) -> None:
    if not isinstance(transform, ChannelTransform):
        raise TypeError(f"transform must be a ragkv.codec.transform.ChannelTransform; got {type(transform).__name__}")
    if transform.model_fingerprint != kv.model_fingerprint:
        raise ValueError(
            f"the channel transform was calibrated for model {transform.model_fingerprint!r}, not "
            f"{kv.model_fingerprint!r}; calibrate one for this model or encode without it"
        )
    if transform.shape != (kv.num_layers, kv.num_kv_heads, kv.head_dim):
        raise ValueError(f"the channel transform is for KV of shape {transform.shape}, not {kv.keys.shape}")


def _coded_in(header: BitstreamHeader, transform: ChannelTransform | None) -> ChannelTransform | None:
    """The transform ``header``'s payload was coded in (None: none), checked before anything is allocated."""
    digest = header.params.get("transform")
    if digest is None:
        return None
    if header.format_version < 4 or not isinstance(digest, str):
        raise CodecError("bitstream's channel-transform parameter is malformed")
    if transform is None or transform.digest != digest:
        raise CodecError(f"bitstream was coded in channel transform {digest[:16]}..., which was not given (a miss)")
    if transform.model_fingerprint != header.model_fingerprint or transform.shape != (
        header.num_layers,
        header.num_kv_heads,
        header.head_dim,
    ):
        raise CodecError("the channel transform does not fit the bitstream's model or shape")
    return transform


def _positions(header: BitstreamHeader) -> torch.Tensor:
    runs = [torch.arange(start, start + length, dtype=torch.int64) for start, length in header.position_runs]
    out = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.int64)
    return out
