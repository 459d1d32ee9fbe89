"""``TieredStore``: tiers stacked fastest first, read down, written through, failing soft.

>>> store = open_store("memory://,memory://?max_bytes=1MiB")
>>> key = "0123456789abcdef/" + "a" * 64
>>> store.put(key, b"kv bytes"), store.get(key)
(True, b'kv bytes')
>>> store.close()
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ragkv.cache._workers import DaemonPool
from ragkv.cache.breaker import CircuitBreaker
from ragkv.cache.fetched import Fetched
from ragkv.cache.keys import validate_key, validate_namespace, validate_value
from ragkv.cache.link import LinkEstimate
from ragkv.cache.registry import open_tier
from ragkv.cache.stats import TierStats
from ragkv.cache.store_config import StoreConfig
from ragkv.cache.tier import Tier
from ragkv.errors import StoreUnavailableError

__all__ = ["TieredStore", "open_store"]

# First guesses of a tier's read throughput (bytes/s), used until it has served a read: an
# in-process tier reads at memory speed; anything else is taken to be a 1 Gbit/s link.
_FIRST_RATE_IN_PROCESS = 2e9
_FIRST_RATE_REMOTE = 125e6
_FIRST_LATENCY_REMOTE = 1e-3  # seconds per request before its first byte (a datacenter round trip)

logger = logging.getLogger(__name__)


class _Failed:
    """Marks a tier call that failed, timed out or was skipped (distinct from a None result)."""


_FAILED = _Failed()


@dataclass(slots=True)
class _Slot:
    tier: Tier
    breaker: CircuitBreaker
    pool: DaemonPool | None  # None: in-process tier, called inline
    read_rate: LinkEstimate  # latency + bytes/s of this tier's reads that found a value


class TieredStore:
    """Stored KV bytes across tiers, fastest first (e.g. memory, local disk, Redis).

    * ``get`` reads down the tiers and promotes a hit into the writable tiers above it;
    * ``put`` writes through to every writable tier, in parallel;
    * a tier that fails or exceeds its ``timeout`` is skipped with a logged warning and an
      ``errors`` count, and after ``breaker_failures`` consecutive failures it is left alone for
      ``breaker_cooldown_s``. ``get``/``get_many``/``put`` never raise for tier faults.

    The store cannot judge bytes: a caller that finds an entry corrupt or truncated calls
    :meth:`invalidate` and treats it as a miss.
    """

    def __init__(self, tiers: Sequence[Tier], config: StoreConfig | None = None) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier, e.g. open_store('memory://')")
        self.config = config or StoreConfig()
        self._slots = [
            _Slot(
                tier=tier,
                breaker=CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooldown_s),
                pool=None
                if tier.in_process or tier.timeout is None
                else DaemonPool(self.config.workers_per_tier, f"ragkv-tier{i}"),
                read_rate=LinkEstimate(_FIRST_RATE_IN_PROCESS, trusted=True)
                if tier.in_process
                else LinkEstimate(_FIRST_RATE_REMOTE, 0.0 if tier.local else _FIRST_LATENCY_REMOTE, trusted=tier.local),
            )
            for i, tier in enumerate(tiers)
        ]
        # Tiers whose entries outlive this process (disk, Redis, object stores): a put counts as
        # stored only when one of them took the value. A document committed on the strength of a
        # memory tier lost its caches when the process ended (issue 33). A store with no such
        # writable tier lives and dies with its process anyway: then every tier counts.
        lasting = [i for i, slot in enumerate(self._slots) if not slot.tier.in_process]
        if not any(self._slots[i].tier.writable for i in lasting):
            lasting = list(range(len(self._slots)))
        self._lasting = frozenset(lasting)
        self._quarantine: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._quarantine_lock = threading.Lock()

    @classmethod
    def from_urls(cls, urls: Sequence[str], config: StoreConfig | None = None) -> TieredStore:
        """Open one tier per URL, fastest first: ``["memory://", "/path/kv", "redis://..."]``."""
        if isinstance(urls, str):
            raise TypeError("from_urls takes a list of URLs; open_store('a,b') splits a string at commas")
        tiers: list[Tier] = []
        try:
            for url in urls:
                tiers.append(open_tier(url))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        return cls(tiers, config)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return tuple(slot.tier for slot in self._slots)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` from the fastest tier that has it, or None. Never raises for tier faults."""
        return self.fetch(key).value

    def fetch(self, key: str) -> Fetched:
        """Like :meth:`get`, also saying which tier served the value, how long it took and whether a
        tier failed on the way. Each hit updates that tier's read throughput estimate."""
        validate_key(key)
        failed: set[int] = set()
        labels = self._labels()
        for i, slot in enumerate(self._slots):
            if self._quarantined(i, key):
                continue
            started = time.perf_counter()
            value = self._call(i, "get", slot.tier.get, key)
            if isinstance(value, bytes):
                seconds = time.perf_counter() - started
                slot.read_rate.observe(len(value), seconds)
                self._promote(i, {key: value}, failed)
                return Fetched(value, labels[i], seconds, bool(failed))
            if value is _FAILED:
                failed.add(i)
        return Fetched(None, None, 0.0, bool(failed))

    def read_rates(self) -> dict[str, float]:
        """Each tier's running estimate of its read throughput in bytes/s, by the names stats() uses
        (a first guess until the tier has served a read)."""
        return {label: slot.read_rate.rate for label, slot in zip(self._labels(), self._slots, strict=True)}

    def read_estimates(self) -> dict[str, LinkEstimate]:
        """Each tier's read cost estimate (latency and bytes/s; ``samples`` 0: still the first guess), by
        the names stats() uses. The objects are live: :meth:`LinkEstimate.seed` seeds a tier."""
        return {label: slot.read_rate for label, slot in zip(self._labels(), self._slots, strict=True)}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The values found for ``keys`` (missing ones left out), in the order asked."""
        wanted = list(dict.fromkeys(validate_key(k) for k in keys))
        found: dict[str, bytes] = {}
        failed: set[int] = set()
        for i, slot in enumerate(self._slots):
            remaining = [k for k in wanted if k not in found and not self._quarantined(i, k)]
            if not remaining:
                continue
            got = self._call(i, "get_many", slot.tier.get_many, remaining)
            if got is _FAILED:
                failed.add(i)
            elif got:
                self._promote(i, got, failed)
                found.update(got)
        return {k: found[k] for k in wanted if k in found}

    def contains(self, key: str) -> bool:
        """Whether any tier holds ``key``."""
        validate_key(key)
        return any(
            self._call(i, "contains", slot.tier.contains, key) is True
            for i, slot in enumerate(self._slots)
            if not self._quarantined(i, key)
        )

    def persisted(self, key: str) -> bool:
        """Whether a tier that outlives this process holds ``key`` (any tier, in a store with no
        writable tier of that kind): what indexing asks before it counts a chunk's cache as stored."""
        validate_key(key)
        return any(
            self._call(i, "contains", self._slots[i].tier.contains, key) is True
            for i in sorted(self._lasting)
            if not self._quarantined(i, key)
        )

    def keys(self, namespace: str) -> Iterator[str]:
        """One tenant namespace's keys across all tiers, each once (tiers that fail are skipped)."""
        validate_namespace(namespace)
        seen: dict[str, None] = {}
        for i, slot in enumerate(self._slots):
            listed = self._call(i, "keys", lambda t=slot.tier: list(t.keys(namespace)))
            for key in listed if isinstance(listed, list) else ():
                if not self._quarantined(i, key):
                    seen.setdefault(key)
        return iter(seen)

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, cost: float | None = None) -> bool:
        """Write ``value`` to every writable tier. True if a tier that outlives this process stored it.

        A value only an in-process tier (``memory://``) took is kept there but reported as not
        stored (with a warning): it is gone when the process ends. In a store made only of
        in-process tiers, any tier storing it counts.

        Args:
            key: a storage key.
            value: the bytes to store.
            cost: recompute-cost hint for cost-aware tiers (e.g. the chunk's token count).
        """
        validate_key(key)
        data = validate_value(value)
        if cost is not None and not cost >= 0:
            raise ValueError(f"cost must be a non-negative number, got {cost!r}")
        # Remote and disk tiers start first, on their threads; in-process ones then run inline.
        writers = sorted(
            (i for i, s in enumerate(self._slots) if s.tier.writable), key=lambda i: self._slots[i].pool is None
        )
        started = {i: self._begin(i, functools.partial(self._slots[i].tier.put, key, data, cost=cost)) for i in writers}
        took = [i for i, pending in started.items() if self._settle(i, "put", pending) is True]
        for i in took:
            self._release(i, key)
        stored = any(i in self._lasting for i in took)
        if took and not stored:
            logger.warning(
                "no lasting tier stored %s (%d bytes): only %s took it, which ends with this process",
                key,
                len(data),
                ", ".join(self._slots[i].tier.name for i in took),
            )
        return stored

    def invalidate(self, key: str) -> bool:
        """Remove ``key`` from every tier (the caller found its bytes corrupt or stale).

        Tiers that cannot delete it (read-only, or failing now) serve it to no one: the store
        remembers the key (up to ``quarantine_size`` keys) and skips those tiers for it; a
        writable tier is trusted again once a new value is put into it.

        Returns:
            True if some tier held the key.
        """
        validate_key(key)
        found = False
        for i, slot in enumerate(self._slots):
            deleted = self._call(i, "invalidate", slot.tier.delete, key) if slot.tier.writable else _FAILED
            if deleted is True:
                found = True
            elif deleted is _FAILED:
                self._hold(i, key)
        return found

    delete = invalidate

    def erase(self, key: str) -> tuple[bool, bool]:
        """Delete ``key`` from every tier, saying whether that is done: what a removal needs.

        Returns:
            (found: some tier held it, gone: no tier holds it now, as far as the tiers can tell). Not
            gone when a tier failed, or a read-only tier holds it or cannot say; such tiers serve
            the key to no one in this process (as :meth:`invalidate`), and the caller keeps its
            record of the key so a later retry finishes the job.
        """
        validate_key(key)
        found, gone = False, True
        for i, slot in enumerate(self._slots):
            if slot.tier.writable:
                deleted = self._call(i, "delete", slot.tier.delete, key)
            else:  # it cannot delete: done only if it does not hold the key
                held = self._call(i, "contains", slot.tier.contains, key)
                deleted = _FAILED if held is not False else False
            if deleted is True:
                found = True
            elif deleted is _FAILED:
                gone = False
                self._hold(i, key)
        return found, gone

    # -- bookkeeping ----------------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters, by tier name (fastest first; a repeated name gets `` [index]``)."""
        return {label: slot.tier.stats() for label, slot in zip(self._labels(), self._slots, strict=True)}

    def usage(self, namespace: str) -> dict[str, tuple[int, int] | None]:
        """One tenant namespace's (entries, value bytes) in each tier, by the names stats() uses.

        None for a tier that cannot tell without a scan (Redis, object stores) or that failed.
        """
        validate_namespace(namespace)
        return {
            label: None if isinstance(found, _Failed) else found
            for label, found in zip(
                self._labels(),
                (self._call(i, "usage", slot.tier.usage, namespace) for i, slot in enumerate(self._slots)),
                strict=True,
            )
        }

    def health(self) -> dict[str, str]:
        """Each tier's circuit state, by the names stats() uses: "closed" (in use), "open" (skipped), "half-open"."""
        return {label: slot.breaker.state for label, slot in zip(self._labels(), self._slots, strict=True)}

    def _labels(self) -> list[str]:
        labels: list[str] = []
        for i, slot in enumerate(self._slots):
            labels.append(slot.tier.name if slot.tier.name not in labels else f"{slot.tier.name} [{i}]")
        return labels

    def close(self) -> None:
        """Close every tier and stop the worker threads."""
        for slot in self._slots:
            if slot.pool is not None:
                slot.pool.shutdown()
            try:
                slot.tier.close()
            except Exception as e:  # closing must reach every tier
                logger.warning("closing tier %s failed: %r", slot.tier.name, e)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- fault handling -------------------------------------------------------------------------

    def _promote(self, found_at: int, values: dict[str, bytes], failed: set[int]) -> None:
        """Copy ``values`` into the writable tiers above ``found_at`` that did not just fail."""
        if not self.config.promote:
            return
        for j in range(found_at):
            if self._slots[j].tier.writable and j not in failed:
                for key, value in values.items():
                    if self._call(j, "promote", self._slots[j].tier.put, key, value) is True:
                        self._release(j, key)

    def _call(self, i: int, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on tier ``i`` within its timeout; ``_FAILED`` if skipped or failed."""
        return self._settle(i, op, self._begin(i, functools.partial(fn, *args)))

    def _begin(self, i: int, call: Callable[[], Any]) -> tuple[Future[Any], float] | None:
        """Start ``call`` on tier ``i``: on its pool, or inline for in-process tiers. None: skipped."""
        slot = self._slots[i]
        if not slot.breaker.allow():
            return None
        started = time.monotonic()
        if slot.pool is not None:
            try:
                return slot.pool.submit(call), started
            except RuntimeError:  # the store was closed
                call = functools.partial(_raise_closed, slot.tier.name)
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(call())
        except Exception as e:
            future.set_exception(e)
        return future, started

    def _settle(self, i: int, op: str, pending: tuple[Future[Any], float] | None) -> Any:
        """Wait for a started call until the tier's deadline; count and log what went wrong."""
        if pending is None:
            return _FAILED
        future, started = pending
        slot = self._slots[i]
        timeout = slot.tier.timeout
        try:
            remaining = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
            result = future.result(timeout=remaining)
        except FutureTimeout:
            future.cancel()
            slot.tier.record_error()
            self._failed(i, op, f"no answer within {timeout:g} s")
            return _FAILED
        except StoreUnavailableError as e:  # the tier counted it already
            self._failed(i, op, str(e))
            return _FAILED
        except Exception as e:  # a fault boundary: the query path must not see tier bugs either
            slot.tier.record_error()
            self._failed(i, op, repr(e))
            return _FAILED
        slot.breaker.success()
        return result

    def _failed(self, i: int, op: str, detail: str) -> None:
        slot = self._slots[i]
        if slot.breaker.failure():
            logger.warning(
                "tier %s: %s failed (%s); skipping it for %g s",
                slot.tier.name,
                op,
                detail,
                self.config.breaker_cooldown_s,
            )
        else:
            logger.warning("tier %s: %s failed (%s); using the other tiers", slot.tier.name, op, detail)

    def _quarantined(self, i: int, key: str) -> bool:
        with self._quarantine_lock:
            return (i, key) in self._quarantine

    def _hold(self, i: int, key: str) -> None:
        with self._quarantine_lock:
            self._quarantine[(i, key)] = None
            while len(self._quarantine) > self.config.quarantine_size:
                self._quarantine.popitem(last=False)

    def _release(self, i: int, key: str) -> None:
        with self._quarantine_lock:
            self._quarantine.pop((i, key), None)


def _raise_closed(name: str) -> None:
    raise StoreUnavailableError(f"tier {name}: the store is closed")


def open_store(urls: str | Sequence[str], config: StoreConfig | None = None) -> TieredStore:
    """Open a TieredStore from ``"URL[,URL...]"`` (the CLI's ``--store``) or a list of URLs.

    Raises:
        ValueError: no URL, an unknown scheme or a bad option.
    """
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    cleaned = [u.strip() for u in items if u.strip()]
    if not cleaned:
        raise ValueError("no store URL given; e.g. --store memory://,/var/cache/ragkv/kv")
    return TieredStore.from_urls(cleaned, config)
