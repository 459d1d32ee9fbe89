"""What a GGUF file is, read from its header alone: refuse an unsupported model before converting it.

Converting a GGUF file (de-quantizing every tensor) takes 30-150 s; knowing that ragkv cannot run
its architecture takes a few hundred bytes. ``read_architecture`` reads the header's key/value
section up to ``general.architecture`` (in practice the first key) and never the tensor data.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic ``GGUF``, ``u32`` version,
``u64`` tensor count, ``u64`` key/value count, then key/value pairs (``u64``-length string key,
``u32`` value type, value), all little-endian.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from ragkv.errors import UnsupportedModelError

__all__ = ["GGUF_FAMILIES", "check_gguf", "read_architecture"]

# GGUF architectures (``general.architecture``) whose transformers model is a decoder ragkv runs
# exactly: each is an "exact" row of the family matrix (tests/model/families.py) and a GGUF
# architecture transformers can load. Others are refused from the header.
GGUF_FAMILIES: tuple[str, ...] = (
    "llama",
    "mistral",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "stablelm",
    "starcoder2",
)

# Why an architecture transformers can read from GGUF is still refused (the family matrix's reasons).
_REFUSED_BECAUSE: dict[str, str] = {
    "gemma2": "it scales embeddings and soft-caps logits outside its decoder layers",
    "gemma3": "it scales embeddings outside its decoder layers",
    "gemma4": "it scales embeddings outside its decoder layers",
    "gpt2": "it uses absolute position embeddings, not RoPE",
    "bloom": "it uses ALiBi, not RoPE",
    "falcon": "its layout is not the Llama-like decoder ragkv drives",
    "mamba": "it is a state-space model with no per-token K/V cache",
    "lfm2": "its convolution layers keep no per-token K/V cache",
    "t5": "it is an encoder-decoder",
    "umt5": "it is an encoder-decoder",
}

_MAGIC = b"GGUF"
_MAX_STRING = 1 << 20  # a key or string value longer than this is a damaged header, not a model
_MAX_KEYS = 1 << 16
# value type -> struct format of a scalar; 8 = string, 9 = array (handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path} is truncated: its GGUF header ends early; fetch the file again")
    return data


def _string(f: BinaryIO, path: Path) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8, path))
    if n > _MAX_STRING:
        raise ValueError(f"{path} has a damaged GGUF header (a string of {n} bytes); fetch the file again")
    return _read(f, n, path).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, kind: int, path: Path) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), 1)
    elif kind == _STRING:
        _string(f, path)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", _read(f, 12, path))
        if item in _SCALARS:  # a fixed-size array is skipped in one seek, never read
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item, path)
    else:
        raise ValueError(f"{path} has a damaged GGUF header (value type {kind}); fetch the file again")


def read_architecture(path: str | Path) -> str:
    """The ``general.architecture`` of a GGUF file, reading its header only.

    Raises:
        ValueError: not a GGUF file, truncated or damaged header, or no architecture key.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(24)
        if head[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        if len(head) < 24:
            raise ValueError(f"{path} is truncated: its GGUF header ends early; fetch the file again")
        _version, _tensors, n_keys = struct.unpack("<IQQ", head[4:24])
        for _ in range(min(n_keys, _MAX_KEYS)):
            key = _string(f, path)
            (kind,) = struct.unpack("<I", _read(f, 4, path))
            if key == "general.architecture" and kind == _STRING:
                return _string(f, path)
            _skip_value(f, kind, path)
    raise ValueError(f"{path} has no general.architecture in its GGUF header; it is not a model file")


def check_gguf(path: str | Path) -> str:
    """Return the file's architecture if ragkv runs it; raise UnsupportedModelError (from the header) if not."""
    arch = read_architecture(path)
    if arch not in GGUF_FAMILIES:
        why = _REFUSED_BECAUSE.get(arch, "ragkv has not verified that its chunk caches can be moved exactly")
        raise UnsupportedModelError(
            f"{Path(path).name}: GGUF architecture {arch!r} is not supported ({why}); ragkv runs GGUF files of "
            f"{', '.join(GGUF_FAMILIES)}"
        )
    return arch
