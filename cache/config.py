"""``TierConfig``: one tier's settings, parsed from its URL.

A tier is named by a URL whose query string carries ragkv's options; every other query option
is the backend's (redis-py connection arguments, fsspec storage options)::

    memory://?max_bytes=1GiB&policy=cost
    /var/cache/ragkv/kv?max_bytes=64GiB      (a plain path is a disk tier)
    disk:///var/cache/ragkv/kv?max_bytes=64GiB
    redis://user:secret@cache:6379/0?ttl=86400&timeout=2
    s3://bucket/kv?write=0&endpoint_url=http://127.0.0.1:9000

>>> TierConfig.from_url("memory://?max_bytes=2MiB&policy=cost").max_bytes
2097152
>>> plain = TierConfig.from_url("/tmp/kv?max_bytes=1KB")
>>> plain.scheme, plain.location, plain.max_bytes
('disk', '/tmp/kv', 1000)
>>> TierConfig.from_url("memory://").display_url
'memory://'
>>> TierConfig.from_url("redis://u:pw@h:6379/0?ttl=60").display_url
'redis://u:***@h:6379/0'
>>> parse_size("1.5KiB")
1536
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = ["TierConfig", "parse_bool", "parse_size", "redact_url"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"1048576"``, ``"512MiB"`` or ``"2GB"``.

    Raises:
        ValueError: not a non-negative size with a known unit (B, KB, MB, GB, TB, KiB .. TiB).
    """
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r}; write e.g. 1048576, 512MiB or 2GB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _parse_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case, spaces around ignored).

    Raises:
        ValueError: anything else.
    """
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"expected 0 or 1, got {text!r}")


# ragkv's own query options: name -> (TierConfig field, parser). Everything else is the backend's.
_OPTIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "max_bytes": ("max_bytes", parse_size),
    "tenant_max_bytes": ("tenant_max_bytes", parse_size),
    "ttl": ("ttl", _parse_seconds),
    "timeout": ("timeout", _parse_seconds),
    "write": ("writable", parse_bool),
    "policy": ("policy", str),
}


_SECRET = re.compile(r"pass|secret|token|key|auth", re.IGNORECASE)  # backend options never shown


def redact_url(url: str) -> str:
    """``url`` without its password and query string, safe to log."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"
    # Not urlunsplit: it drops the "//" of an empty host ("memory://" would become "memory:").
    return f"{parts.scheme}://{netloc}{parts.path}"


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier's settings. Build it with :meth:`from_url`."""

    scheme: str  # registry key: "memory", "disk", "redis", "rediss", or an fsspec protocol
    location: str  # the URL without its query (a path for disk tiers); may hold a password
    max_bytes: int | None = None  # byte budget of the whole tier; None: the tier's default
    tenant_max_bytes: int | None = None  # byte budget of one tenant namespace; None: max_bytes
    ttl: float | None = None  # seconds an entry lives; None: until evicted
    timeout: float | None = None  # seconds one call may take; None: the tier's default
    writable: bool = True  # False: a read-only tier; put and delete are refused
    policy: str = "lru"  # eviction policy: "lru" or "cost" (see ragkv.cache.policy)
    options: tuple[tuple[str, str], ...] = ()  # the backend's query options, in URL order
    given: frozenset[str] = frozenset()  # ragkv options the URL set explicitly

    def __repr__(self) -> str:
        # location may carry a password (redis://:pw@host): shown redacted, as redact_url logs it
        shown: dict[str, object] = {
            "location": redact_url(self.location) if "://" in self.location else self.location,
            "options": tuple((k, "***" if _SECRET.search(k) else v) for k, v in self.options),
        }
        parts = [f"{f.name}={shown.get(f.name, getattr(self, f.name))!r}" for f in fields(self)]
        return f"TierConfig({', '.join(parts)})"

    @classmethod
    def from_url(cls, url: str) -> TierConfig:
        """Parse a tier URL (or a plain filesystem path, which names a disk tier).

        Raises:
            ValueError: an option has a bad value.
        """
        if not isinstance(url, str) or not url.strip():
            raise ValueError("a tier URL must be a non-empty string, e.g. 'memory://' or '/path/kv'")
        url = url.strip()
        scheme, rest = url.split("://", 1) if "://" in url else ("disk", url)
        scheme = scheme.lower()
        location, _, query = rest.partition("?")
        fields: dict[str, Any] = {}
        options: list[tuple[str, str]] = []
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name not in _OPTIONS:
                options.append((name, value))
                continue
            field, parse = _OPTIONS[name]
            try:
                fields[field] = parse(value)
            except ValueError as e:
                raise ValueError(f"tier URL {redact_url(url)!r}: option {name}={value!r}: {e}") from e
        # disk:///abs/path and disk://rel/path both name a path; other schemes keep their URL.
        location = location if scheme == "disk" else f"{scheme}://{location}"
        return cls(
            scheme=scheme,
            location=location,
            options=tuple(options),
            given=frozenset(fields),
            **fields,
        )

    @property
    def display_url(self) -> str:
        """The location without password or query, for logs and stats."""
        return redact_url(self.location) if "://" in self.location else f"disk://{self.location}"

    def option_dict(self) -> dict[str, str]:
        """The backend's query options as a dict (the last value of a repeated name wins)."""
        return dict(self.options)
