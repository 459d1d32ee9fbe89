"""``MemoryTier``: process-local, byte-budgeted, thread-safe (``memory://``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from ragkv.cache.config import TierConfig
from ragkv.cache.entry_meta import EntryMeta
from ragkv.cache.fair_share import fair_victims
from ragkv.cache.policy import policy_for
from ragkv.cache.tier import Tier

__all__ = ["MemoryTier"]


@dataclass(slots=True)
class _Slot:
    value: bytes
    hits: int  # reads since stored
    last_access: float  # logical clock: exact order, no ties
    cost: float | None  # put's recompute-cost hint


class MemoryTier(Tier):
    """Values in this process's memory, evicted by policy when a byte budget is exceeded.

    URL: ``memory://?max_bytes=1GiB&tenant_max_bytes=256MiB&policy=lru|cost``.

    A put evicts its own tenant's entries first. A tenant within its fair share of the budget (split
    evenly among the tenants holding entries) is never locked out by tenants that filled the tier:
    the room it needs is taken from those over their share, never below it (as the disk tier
    does; ``ragkv.cache.fair_share``). ``tenant_max_bytes`` caps each tenant's share.
    """

    accepts: ClassVar[frozenset[str]] = frozenset({"writable", "timeout", "max_bytes", "tenant_max_bytes", "policy"})
    in_process: ClassVar[bool] = True
    local: ClassVar[bool] = True
    default_timeout: ClassVar[float | None] = None
    default_max_bytes: ClassVar[int] = 1 << 30

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        self._max_bytes = config.max_bytes if config.max_bytes is not None else self.default_max_bytes
        self._tenant_max_bytes = min(config.tenant_max_bytes or self._max_bytes, self._max_bytes)
        self._policy = policy_for(config.policy)
        self._lock = threading.Lock()
        self._spaces: dict[str, dict[str, _Slot]] = {}  # namespace -> key -> slot
        self._space_bytes: dict[str, int] = {}
        self._total_bytes = 0
        self._clock = itertools.count()

    @classmethod
    def from_url(cls, url: str = "memory://") -> MemoryTier:
        """Open a memory tier from its URL."""
        return cls(TierConfig.from_url(url))

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            slot = self._spaces.get(key[:16], {}).get(key)
            if slot is None:
                return None
            slot.hits += 1
            slot.last_access = float(next(self._clock))
            return slot.value

    def _put(self, key: str, value: bytes, cost: float | None) -> bool:
        namespace, nbytes = key[:16], len(value)
        if nbytes > self._tenant_max_bytes:
            return False
        with self._lock:
            space = self._spaces.setdefault(namespace, {})
            old = space.get(key)
            old_nbytes = len(old.value) if old is not None else 0
            space_bytes = self._space_bytes.get(namespace, 0)
            need = max(
                self._total_bytes - old_nbytes + nbytes - self._max_bytes,
                space_bytes - old_nbytes + nbytes - self._tenant_max_bytes,
                0,
            )
            if need and not self._evict(namespace, key, total_after=self._total_bytes - old_nbytes + nbytes,
                                        space_after=space_bytes - old_nbytes + nbytes):  # fmt: skip
                if not space:
                    del self._spaces[namespace]
                return False
            space = self._spaces.setdefault(namespace, {})  # eviction may have dropped the old dict
            space[key] = _Slot(value, 0, float(next(self._clock)), cost)
            self._space_bytes[namespace] = self._space_bytes.get(namespace, 0) - old_nbytes + nbytes
            self._total_bytes += nbytes - old_nbytes
            return True

    def _evict(self, namespace: str, keep: str, *, total_after: int, space_after: int) -> bool:
        """Make room for ``keep`` (lock held): the writer's own entries by policy, and, for a writer
        within its fair share, room taken from tenants over theirs (``ragkv.cache.fair_share``).
        False: cannot, nothing done."""

        def entries(ns: str) -> list[EntryMeta]:
            slots = self._spaces.get(ns, {})
            return [EntryMeta(k, len(s.value), s.hits, s.last_access, s.cost) for k, s in slots.items() if k != keep]

        others = {ns: (self._space_bytes[ns], entries(ns)) for ns in self._spaces if ns != namespace}
        victims = fair_victims(
            self._policy,
            entries(namespace),
            others,
            need_tier=max(total_after - self._max_bytes, 0),
            need_own=max(space_after - self._tenant_max_bytes, 0),
            fair_share=self._max_bytes // (len(others) + 1),
            writer_after=space_after,
        )
        if victims is None:
            return False
        for victim in victims:
            self._remove(victim.key)
        self._record_evictions(len(victims))
        return True

    def _remove(self, key: str) -> bool:
        namespace = key[:16]
        slot = self._spaces.get(namespace, {}).pop(key, None)
        if slot is None:
            return False
        self._space_bytes[namespace] -= len(slot.value)
        self._total_bytes -= len(slot.value)
        if not self._spaces[namespace]:
            del self._spaces[namespace], self._space_bytes[namespace]
        return True

    def _delete(self, key: str) -> bool:
        with self._lock:
            return self._remove(key)

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._spaces.get(key[:16], {})

    def _keys(self, namespace: str) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._spaces.get(namespace, {}))
        return iter(snapshot)

    def _usage(self) -> tuple[int | None, int | None]:
        with self._lock:
            return sum(map(len, self._spaces.values())), self._total_bytes

    def _namespace_usage(self, namespace: str) -> tuple[int, int] | None:
        with self._lock:
            return len(self._spaces.get(namespace, {})), self._space_bytes.get(namespace, 0)

    def _close(self) -> None:
        with self._lock:
            self._spaces.clear()
            self._space_bytes.clear()
            self._total_bytes = 0
