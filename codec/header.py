"""The self-describing header of a ragkv bitstream, and its canonical JSON encoding."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ragkv.errors import CodecError

__all__ = ["AUTH_HMAC_SHA256", "BitstreamHeader", "MAX_ELEMENTS"]

# A header that passed its checksum can still be hostile (crafted, not damaged). Shapes past
# these bounds are refused before anything is allocated for them.
MAX_ELEMENTS = 1 << 36  # per tensor (keys or values): 128 GiB of fp16
_MAX_DIM = 1 << 24
_SOURCE_DTYPES = ("float16", "bfloat16", "float32", "float64")
AUTH_HMAC_SHA256 = "hmac-sha256"  # the bitstream ends with a 32-byte HMAC-SHA256 tag (see codec/trust.py)
_AUTH_SCHEMES = ("", AUTH_HMAC_SHA256)
_MAX_KEY = 256  # storage keys are "<16 hex>/<64 hex>"; anything far longer is not one


@dataclass(frozen=True, slots=True)
class BitstreamHeader:
    """Everything a decoder needs to know about a chunk's bitstream, before its payload.

    Shapes are those of the chunk's ``ChunkKV``: keys and values ``[layers, kv_heads, tokens,
    head_dim]``. Positions are kept as runs so that the usual contiguous chunk costs a few bytes.
    """

    format_version: int  # bitstream format version the bytes were written with
    codec: str  # codec name in the registry
    level: int  # codec quality level
    num_layers: int
    num_kv_heads: int
    num_tokens: int
    head_dim: int
    source_dtype: str  # dtype of the tensors that were encoded, e.g. "float16"
    model_fingerprint: str  # ModelAdapter.fingerprint of the model that computed the KV
    position_runs: tuple[tuple[int, int], ...]  # (first position, run length) of consecutive positions
    section_sizes: tuple[int, ...]  # byte length of each payload section, in order
    params: Mapping[str, Any] = field(default_factory=dict)  # codec parameters (JSON values)
    # The storage key the bytes were written for ("<namespace>/<digest>", which digests tenant,
    # model, tokenizer, prefix, tokens, codec, level and format): a blob copied under another key
    # names the wrong one. Required from format 2 on; "" in format 1.
    storage_key: str = ""
    auth: str = ""  # "" or AUTH_HMAC_SHA256: the bitstream ends with an authentication tag

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(layers, kv_heads, tokens, head_dim)`` of keys (and of values)."""
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)

    @property
    def num_elements(self) -> int:
        """Elements in keys plus values."""
        return 2 * math.prod(self.shape)

    @property
    def payload_nbytes(self) -> int:
        """Length of the payload, all sections together."""
        return sum(self.section_sizes)

    @property
    def tag_nbytes(self) -> int:
        """Length of the authentication tag that ends the bitstream (0: none)."""
        return 32 if self.auth == AUTH_HMAC_SHA256 else 0

    def positions(self) -> list[int]:
        """The positions the keys were rotated at, one per token."""
        out: list[int] = []
        for start, length in self.position_runs:
            out.extend(range(start, start + length))
        return out

    def to_json_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, ASCII): equal headers give equal bytes."""
        doc = {
            "codec": self.codec,
            "dtype": self.source_dtype,
            "fingerprint": self.model_fingerprint,
            "format": self.format_version,
            "head_dim": self.head_dim,
            "heads": self.num_kv_heads,
            "key": self.storage_key,
            "layers": self.num_layers,
            "level": self.level,
            "params": dict(self.params),
            "positions": [list(run) for run in self.position_runs],
            "sections": list(self.section_sizes),
            "tokens": self.num_tokens,
        }
        if self.format_version < 2:
            del doc["key"]
        if self.auth:
            doc["auth"] = self.auth
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
            "ascii"
        )

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> BitstreamHeader:
        """Parse and validate a header written by :meth:`to_json_bytes`.

        Raises:
            CodecError: the bytes are not a well-formed header.
        """
        try:
            doc = json.loads(raw.decode("ascii"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CodecError(f"bitstream header is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise CodecError("bitstream header must be a JSON object")
        version = _int(doc, "format", 1)
        header = cls(
            format_version=version,
            codec=_str(doc, "codec"),
            level=_int(doc, "level", 0),
            num_layers=_int(doc, "layers", 1),
            num_kv_heads=_int(doc, "heads", 1),
            num_tokens=_int(doc, "tokens", 0),
            head_dim=_int(doc, "head_dim", 1),
            source_dtype=_str(doc, "dtype"),
            model_fingerprint=_str(doc, "fingerprint"),
            position_runs=_runs(doc.get("positions")),
            section_sizes=_sizes(doc.get("sections")),
            params=_params(doc.get("params")),
            storage_key=_str(doc, "key") if version >= 2 else "",
            auth=_str(doc, "auth") if "auth" in doc else "",
        )
        header.validate()
        return header

    def validate(self) -> None:
        """Check the fields agree with each other.

        Raises:
            CodecError: a field is out of range or contradicts another.
        """
        if math.prod(self.shape) > MAX_ELEMENTS:
            raise CodecError(f"bitstream header shape {self.shape} is implausibly large")
        if self.source_dtype not in _SOURCE_DTYPES:
            raise CodecError(f"bitstream header has unknown source dtype {self.source_dtype!r}")
        if sum(length for _, length in self.position_runs) != self.num_tokens:
            raise CodecError("bitstream header positions do not cover its tokens")
        if self.format_version >= 2 and not 0 < len(self.storage_key) <= _MAX_KEY:
            raise CodecError("bitstream header does not name the storage key it was written for")
        if self.auth not in _AUTH_SCHEMES or (self.auth and self.format_version < 2):
            raise CodecError(f"bitstream uses authentication {self.auth!r}, unknown to its format version")


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def _int(doc: Mapping[str, Any], key: str, minimum: int, maximum: int = 1 << 62) -> int:
    value = doc.get(key)
    # bool is an int subclass; a header never stores one where a number belongs.
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise CodecError(f"bitstream header field {key!r} must be an integer >= {minimum}; got {value!r}")
    if key in ("layers", "heads", "tokens", "head_dim") and value > _MAX_DIM:
        raise CodecError(f"bitstream header field {key!r} is implausibly large: {value}")
    return value


def _str(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise CodecError(f"bitstream header field {key!r} must be a string; got {value!r}")
    return value


def _runs(value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        raise CodecError("bitstream header field 'positions' must be a list of runs")
    runs = []
    for run in value:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in run)
            or not (-(1 << 62) <= run[0] < (1 << 62) and 1 <= run[1] <= _MAX_DIM)
        ):
            raise CodecError(f"bitstream header has a malformed position run {run!r}")
        runs.append((run[0], run[1]))
    return tuple(runs)


def _sizes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 48) for v in value
    ):
        raise CodecError("bitstream header field 'sections' must be a list of byte counts")
    return tuple(value)


def _params(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CodecError("bitstream header field 'params' must be an object")
    return value


def position_runs(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """Run-length form of ``positions``: maximal runs of consecutive integers.

    >>> position_runs([5, 6, 7, 3, 4])
    ((5, 3), (3, 2))
    >>> position_runs([])
    ()
    """
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return tuple(runs)
