"""What a GGUF file is, read from its header alone: refuse an unsupported model before converting it.

Converting a GGUF file (de-quantizing every tensor) takes 30-150 s; knowing that ragkv cannot run
its architecture takes a few hundred bytes. ``read_architecture`` reads the header's key/value
section up to ``general.architecture`` (in practice the first key) and never the tensor data.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic ``GGUF``, ``u32`` version,
``u64`` tensor count, ``u64`` key/value count, then key/value pairs (``u64``-length string key,
``u32`` value type, value), all little-endian.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import BinaryIO

from ragkv.errors import UnsupportedModelError

__all__ = ["GGUF_FAMILIES", "QUANT_BITS", "check_gguf", "read_architecture", "read_tensor_types", "weight_bits"]

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
        elif item == _STRING:  # a vocabulary: 150K strings, skipped by their lengths in a mapped view
            f.seek(_skip_strings(f, count, path))
        else:
            for _ in range(count):
                _skip_value(f, item, path)
    else:
        raise ValueError(f"{path} has a damaged GGUF header (value type {kind}); fetch the file again")


# ggml tensor type id -> (name, bits of each stored value: the grid a weight is rounded to)
QUANT_BITS: dict[int, tuple[str, int]] = {
    0: ("F32", 32), 1: ("F16", 16), 2: ("Q4_0", 4), 3: ("Q4_1", 4), 6: ("Q5_0", 5), 7: ("Q5_1", 5),
    8: ("Q8_0", 8), 9: ("Q8_1", 8), 10: ("Q2_K", 2), 11: ("Q3_K", 3), 12: ("Q4_K", 4), 13: ("Q5_K", 5),
    14: ("Q6_K", 6), 15: ("Q8_K", 8), 16: ("IQ2_XXS", 2), 17: ("IQ2_XS", 2), 18: ("IQ3_XXS", 3),
    19: ("IQ1_S", 1), 20: ("IQ4_NL", 4), 21: ("IQ3_S", 3), 22: ("IQ2_S", 2), 23: ("IQ4_XS", 4),
    29: ("IQ1_M", 1), 30: ("BF16", 16), 34: ("TQ1_0", 2), 35: ("TQ2_0", 2),
}  # fmt: skip


def _open_header(f: BinaryIO, path: Path) -> tuple[int, int]:
    """Check the magic; return (tensor count, key/value count), the file positioned at the first key."""
    head = f.read(24)
    if head[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    if len(head) < 24:
        raise ValueError(f"{path} is truncated: its GGUF header ends early; fetch the file again")
    _version, n_tensors, n_keys = struct.unpack("<IQQ", head[4:24])
    return n_tensors, n_keys


def read_tensor_types(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's ggml type name and shape (ggml order: the row length first), from the header.

    Reads the key/value section (skipping values) and the tensor infos, never the tensor data.

    Raises:
        ValueError: not a GGUF file, or a truncated or damaged header.
    """
    path = Path(path)
    with path.open("rb", buffering=1 << 20) as f:
        n_tensors, n_keys = _open_header(f, path)
        if n_keys > _MAX_KEYS or n_tensors > _MAX_KEYS:
            raise ValueError(f"{path} has a damaged GGUF header ({n_keys} keys, {n_tensors} tensors)")
        for _ in range(n_keys):
            _string(f, path)
            (kind,) = struct.unpack("<I", _read(f, 4, path))
            _skip_value(f, kind, path)
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for _ in range(n_tensors):
            name = _string(f, path)
            (n_dims,) = struct.unpack("<I", _read(f, 4, path))
            if n_dims > 8:
                raise ValueError(f"{path} has a damaged GGUF header (tensor {name} has {n_dims} dimensions)")
            dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims, path))
            kind, _offset = struct.unpack("<IQ", _read(f, 12, path))
            tensors[name] = (QUANT_BITS.get(kind, (f"type{kind}", 0))[0], tuple(dims))
    return tensors


def weight_bits(path: str | Path) -> int | None:
    """The most bits any matrix of the file's decoder layers stores a weight value in (a Q4_K file's
    Q6_K layers make it 6), or None when a type is unknown. Embedding and output matrices are left out
    (the int8 decode copy keeps the embedding, and its LM head is int8 in every format)."""
    bits = []
    by_name = {name: bits for name, bits in QUANT_BITS.values()}
    for name, (kind, dims) in read_tensor_types(path).items():
        if len(dims) == 2 and name.startswith("blk."):
            if kind not in by_name:
                return None
            bits.append(by_name[kind])
    return max(bits) if bits else None


def _skip_strings(f: BinaryIO, count: int, path: Path) -> int:
    """The file position after ``count`` strings starting at ``f``'s position."""
    pos = f.tell()
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        size = len(view)
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"{path} is truncated: its GGUF header ends early; fetch the file again")
            (n,) = struct.unpack_from("<Q", view, pos)
            if n > _MAX_STRING:
                raise ValueError(f"{path} has a damaged GGUF header (a string of {n} bytes); fetch the file again")
            pos += 8 + n
    if pos > size:
        raise ValueError(f"{path} is truncated: its GGUF header ends early; fetch the file again")
    return pos


def read_architecture(path: str | Path) -> str:
    """The ``general.architecture`` of a GGUF file, reading its header only.

    Raises:
        ValueError: not a GGUF file, truncated or damaged header, or no architecture key.
    """
    path = Path(path)
    with path.open("rb") as f:
        _tensors, n_keys = _open_header(f, path)
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
