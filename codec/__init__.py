"""ragkv.codec: a chunk's KV cache to a self-describing, checksummed bitstream and back.

>>> import torch
>>> from ragkv.types import ChunkKV, CodecSpec, StorageKey
>>> kv = ChunkKV(torch.zeros(2, 1, 3, 4), torch.ones(2, 1, 3, 4), torch.arange(3), "m")
>>> key, raw = StorageKey("0123456789abcdef/00ff"), CodecSpec("raw", 0)
>>> data = encode(kv, raw, key=key).data
>>> decode(data, expect=Expected(key, "m", raw, 2, 1, 4, num_tokens=3)).values.sum().item()
24.0
>>> decode(data, expect=Expected(StorageKey("0123456789abcdef/ff00"), "m", raw, 2, 1, 4, 3))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ragkv.errors.IncompatibleCacheError: bitstream was written for key '0123456789abcdef/00ff', not for ...
"""

from ragkv.codec import cachegen as _cachegen  # noqa: F401  (registers the codec)
from ragkv.codec import int4 as _int4  # noqa: F401
from ragkv.codec import int8 as _int8  # noqa: F401
from ragkv.codec import raw as _raw  # noqa: F401
from ragkv.codec.api import decode, encode
from ragkv.codec.base import Codec
from ragkv.codec.bitstream import FORMAT_VERSION, read_header
from ragkv.codec.header import BitstreamHeader
from ragkv.codec.payload import CodecPayload
from ragkv.codec.registry import available_codecs, get_codec, register_codec
from ragkv.codec.trust import Expected

__all__ = [
    "FORMAT_VERSION",
    "BitstreamHeader",
    "Codec",
    "CodecPayload",
    "Expected",
    "available_codecs",
    "decode",
    "encode",
    "get_codec",
    "read_header",
    "register_codec",
]
