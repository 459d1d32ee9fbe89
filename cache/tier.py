"""``Tier``: the bytes interface every storage tier implements.

A tier stores opaque values under storage keys (``"<namespace>/<digest>"``, see
``ragkv.cache.keys``). The public methods here validate keys, refuse writes to read-only tiers
and keep the counters; subclasses implement the ``_``-prefixed primitives and translate their
backend's failures into ``StoreUnavailableError`` (``raise ... from e``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import ClassVar, TypeVar

from ragkv.cache.config import TierConfig
from ragkv.cache.keys import validate_key, validate_namespace, validate_value
from ragkv.cache.stats import TierStats
from ragkv.errors import StoreUnavailableError

__all__ = ["Tier"]

T = TypeVar("T")
_COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "evictions", "errors", "refused")


class Tier(ABC):
    """A store of bytes by storage key. Thread-safe.

    Methods raise ``StoreUnavailableError`` when the backend is down, slow or full beyond
    repair, and ``ValueError`` / ``TypeError`` for malformed keys or values.
    """

    # ragkv URL options (TierConfig field names) this tier understands; others are refused.
    accepts: ClassVar[frozenset[str]] = frozenset({"writable", "timeout"})
    # True: the backend's own query options (redis-py, fsspec) are passed through.
    takes_backend_options: ClassVar[bool] = False
    # True: calls run in-process and cannot hang, so TieredStore need not bound them.
    in_process: ClassVar[bool] = False
    # on this machine (memory, local disk): its first read-speed guess is planned on without a probe
    local: ClassVar[bool] = False
    # Seconds one call may take when the URL sets no timeout; None: unbounded.
    default_timeout: ClassVar[float | None] = 10.0

    def __init__(self, config: TierConfig) -> None:
        unsupported = config.given - self.accepts
        if unsupported:
            raise ValueError(
                f"{type(self).__name__} ({config.display_url}) does not take option(s) "
                f"{sorted(unsupported)}; it takes {sorted(self.accepts)}"
            )
        if config.options and not self.takes_backend_options:
            raise ValueError(
                f"{type(self).__name__} ({config.display_url}): unknown option(s) "
                f"{sorted(dict(config.options))}; ragkv options are max_bytes, tenant_max_bytes, ttl, "
                "timeout, write, policy"
            )
        self.config = config
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._counts_lock = threading.Lock()
        self._closed = False

    # -- what callers use ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The tier's URL without password or query, for logs and stats."""
        return self.config.display_url

    @property
    def writable(self) -> bool:
        """False for read-only tiers (``write=0``)."""
        return self.config.writable

    @property
    def timeout(self) -> float | None:
        """Seconds one call may take (the URL's ``timeout=``, else the tier's default)."""
        return self.config.timeout if self.config.timeout is not None else self.default_timeout

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None."""
        validate_key(key)
        value = self._call(self._get, key)
        self._count_lookups([value])
        return value

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The values found for ``keys`` (missing keys are left out), in the order asked."""
        wanted = list(dict.fromkeys(validate_key(k) for k in keys))
        if not wanted:
            return {}
        found = self._call(self._get_many, wanted)
        ordered = {k: found[k] for k in wanted if k in found}
        self._count_lookups([ordered.get(k) for k in wanted])
        return ordered

    def put(self, key: str, value: bytes, *, cost: float | None = None) -> bool:
        """Store ``value`` under ``key``, replacing any old value.

        Args:
            key: a storage key.
            value: the bytes to store.
            cost: recompute-cost hint for cost-aware eviction (e.g. the chunk's token count).

        Returns:
            True if stored; False if refused (read-only tier, value larger than the budget, or
            the tenant's entries cannot make room).
        """
        validate_key(key)
        data = validate_value(value)
        if cost is not None and not cost >= 0:
            raise ValueError(f"cost must be a non-negative number, got {cost!r}")
        if not self.writable:
            return False
        stored = self._call(self._put, key, data, cost)
        if stored:
            self._add(bytes_in=len(data))
        else:
            self._add(refused=1)
        return stored

    def delete(self, key: str) -> bool:
        """Remove ``key``. Returns True if it was there (False on read-only tiers)."""
        validate_key(key)
        if not self.writable:
            return False
        return self._call(self._delete, key)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (not counted as a hit or miss)."""
        validate_key(key)
        return self._call(self._contains, key)

    def keys(self, namespace: str) -> Iterator[str]:
        """The storage keys of one tenant namespace (``ragkv.types.tenant_namespace``)."""
        validate_namespace(namespace)
        # Listed in full inside _call, so backend failures surface here, as StoreUnavailableError.
        return iter(self._call(lambda: list(self._keys(namespace))))

    def usage(self, namespace: str) -> tuple[int, int] | None:
        """(entries, value bytes) one tenant namespace holds now; None if the tier cannot tell cheaply."""
        validate_namespace(namespace)
        return self._call(self._namespace_usage, namespace)

    def stats(self) -> TierStats:
        """Counters since open, plus current entries and bytes where the tier can tell cheaply."""
        try:
            entries, nbytes = self._usage() if not self._closed else (None, None)
        except StoreUnavailableError:
            entries, nbytes = None, None
        with self._counts_lock:
            counts = dict(self._counts)
        return TierStats(**counts, entries=entries, bytes_stored=nbytes)

    def record_error(self) -> None:
        """Count a failure seen outside the tier (TieredStore's deadline ran out)."""
        self._add(errors=1)

    def close(self) -> None:
        """Release connections and files. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Tier:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- what subclasses implement --------------------------------------------------------------

    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        found = {}
        for key in keys:
            value = self._get(key)
            if value is not None:
                found[key] = value
        return found

    @abstractmethod
    def _put(self, key: str, value: bytes, cost: float | None) -> bool: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abstractmethod
    def _contains(self, key: str) -> bool: ...

    @abstractmethod
    def _keys(self, namespace: str) -> Iterator[str]: ...

    def _usage(self) -> tuple[int | None, int | None]:
        """(entries, value bytes) stored now; (None, None) when it would need a scan."""
        return None, None

    def _namespace_usage(self, namespace: str) -> tuple[int, int] | None:
        """(entries, value bytes) of one namespace; None when it would need a scan."""
        return None

    def _close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""

    # -- helpers for subclasses -----------------------------------------------------------------

    def _record_evictions(self, count: int) -> None:
        if count:
            self._add(evictions=count)

    def _add(self, **deltas: int) -> None:
        with self._counts_lock:
            for counter, delta in deltas.items():
                self._counts[counter] += delta

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"tier {self.name} is closed")

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        self._check_open()
        try:
            return fn(*args)
        except StoreUnavailableError:
            self._add(errors=1)
            raise

    def _count_lookups(self, values: list[bytes | None]) -> None:
        hits = [v for v in values if v is not None]
        self._add(hits=len(hits), misses=len(values) - len(hits), bytes_out=sum(map(len, hits)))
