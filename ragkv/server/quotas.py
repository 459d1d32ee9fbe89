"""Per-tenant quotas: stored document bytes, cache bytes, requests per minute, concurrent generations.

One tenant over its quota gets 429 (rate, slots) or 413 (bytes) naming the limit; the others are
untouched. Defaults come from ``ServerSettings.quota``; a keys-file line may set its tenant's own
(``KEY TENANT requests_per_minute=60 concurrent=2 document_bytes=10MiB cache_bytes=1GiB``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields, replace

__all__ = ["QuotaError", "Quotas", "TenantQuota"]


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """What one tenant may use; None: no limit of that kind."""

    document_bytes: int | None = 256 * 1024**2  # UTF-8 bytes of indexed text (chunk texts)
    cache_bytes: int | None = 8 * 1024**3  # bytes of chunk caches in the fullest tier that can tell
    requests_per_minute: int | None = None  # API requests in any 60 s window
    concurrent: int | None = None  # generations queued or decoding at once

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"quota {f.name} must be a positive integer or None, got {value!r}")

    def with_words(self, words: list[str]) -> TenantQuota:
        """This quota with ``name=value`` words applied (sizes take units: ``10MiB``; ``none``: no limit).

        >>> TenantQuota().with_words(["concurrent=2", "document_bytes=1KiB", "cache_bytes=none"])
        TenantQuota(document_bytes=1024, cache_bytes=None, requests_per_minute=None, concurrent=2)
        """
        from ragkv.cache.config import parse_size

        names = {f.name for f in fields(self)}
        changes: dict[str, int | None] = {}
        for word in words:
            name, eq, value = word.partition("=")
            if not eq or name not in names:
                raise ValueError(f"quota {word!r}: expected NAME=VALUE with NAME one of {sorted(names)}")
            changes[name] = None if value.lower() == "none" else parse_size(value)
        return replace(self, **changes)


class QuotaError(Exception):
    """A tenant is over one of its quotas; ``status`` is the HTTP answer (429 or 413), ``retry_after``
    its ``Retry-After`` seconds (a rate's window, a slot's second; None for sizes)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class Quotas:
    """The quotas in force and each tenant's rate window and running generations (thread-safe)."""

    def __init__(self, default: TenantQuota, per_tenant: dict[str, TenantQuota]) -> None:
        self.default, self.per_tenant = default, dict(per_tenant)
        self._lock = threading.Lock()
        self._recent: defaultdict[str, deque[float]] = defaultdict(deque)  # request times in the last minute
        self._running: defaultdict[str, int] = defaultdict(int)

    def of(self, tenant: str) -> TenantQuota:
        return self.per_tenant.get(tenant, self.default)

    def count_request(self, tenant: str, now: float | None = None) -> None:
        """Record a request; raises QuotaError (429) past ``requests_per_minute``."""
        limit = self.of(tenant).requests_per_minute
        if limit is None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            recent = self._recent[tenant]
            while recent and recent[0] <= now - 60:
                recent.popleft()
            if len(recent) >= limit:
                raise QuotaError(429, f"tenant {tenant!r} is over its requests_per_minute quota of {limit}; "
                                 f"retry in {int(recent[0] + 60 - now) + 1} s", 60)  # fmt: skip
            recent.append(now)

    def start_generation(self, tenant: str) -> None:
        """Hold one of the tenant's generation slots; raises QuotaError (429) past ``concurrent``."""
        limit = self.of(tenant).concurrent
        with self._lock:
            if limit is not None and self._running[tenant] >= limit:
                raise QuotaError(429, f"tenant {tenant!r} already runs its concurrent quota of {limit} "
                                 "generations; wait for one to finish", 1)  # fmt: skip
            self._running[tenant] += 1

    def end_generation(self, tenant: str) -> None:
        with self._lock:
            self._running[tenant] = max(0, self._running[tenant] - 1)

    def running(self, tenant: str) -> int:
        with self._lock:
            return self._running[tenant]

    def check_upload(self, tenant: str, stored_text: int, adding_text: int, cache_bytes: int | None) -> None:
        """Raises QuotaError (413) when an upload would pass ``document_bytes`` or the cache is full."""
        quota = self.of(tenant)
        if quota.document_bytes is not None and stored_text + adding_text > quota.document_bytes:
            raise QuotaError(413, f"tenant {tenant!r} would hold {stored_text + adding_text} bytes of documents, "
                             f"over its document_bytes quota of {quota.document_bytes}; remove some first")  # fmt: skip
        if quota.cache_bytes is not None and cache_bytes is not None and cache_bytes >= quota.cache_bytes:
            raise QuotaError(413, f"tenant {tenant!r} holds {cache_bytes} bytes of chunk caches, at its cache_bytes "
                             f"quota of {quota.cache_bytes}; remove documents first")  # fmt: skip
