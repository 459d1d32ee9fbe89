"""Fair shares of a bounded tier: no tenant's entries push out, or lock out, another's.

A tier with a byte budget shared by tenants evicts, to make room for one tenant's write, that
tenant's own entries first choice, as always. But a tenant still within its fair share of the tier
(the budget split evenly among the tenants holding entries, the writer counted) is not locked out
by tenants that filled the tier before it: the room its write needs beyond its own budget is taken
from the tenants over their fair share, the most over first, each by its own eviction order and
never below its share. Before this, one tenant filling a shared 1 MiB disk tier made every other
tenant's upload fail (issue 33).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ragkv.cache.entry_meta import EntryMeta
from ragkv.cache.policy import EvictionPolicy

__all__ = ["fair_victims"]


def fair_victims(
    policy: EvictionPolicy,
    own: Sequence[EntryMeta],
    others: Mapping[str, tuple[int, Sequence[EntryMeta]]],
    *,
    need_tier: int,
    need_own: int,
    fair_share: int,
    writer_after: int,
) -> list[EntryMeta] | None:
    """The entries to evict so a write fits, or None when it cannot (nothing is evicted then).

    Args:
        policy: the tier's eviction order.
        own: the writer's entries (the key being replaced left out).
        others: the other tenants' (bytes held, entries), by namespace.
        need_tier: bytes the whole tier must free (its budget), 0 if none.
        need_own: bytes the writer's namespace must free (its own budget), 0 if none.
        fair_share: bytes each tenant may hold for sure (the tier's budget / tenants).
        writer_after: bytes the writer holds once the write is done (before any eviction).

    >>> from ragkv.cache.policy import policy_for
    >>> bob = [EntryMeta(f"b{i}", 100, 0, float(i), None) for i in range(3)]
    >>> [v.key for v in fair_victims(policy_for("lru"), [], {"bob": (300, bob)}, need_tier=100,
    ...  need_own=0, fair_share=150, writer_after=100)]
    ['b0']
    """
    taken: list[EntryMeta] = []
    want = need_tier - need_own  # what the tier needs beyond what the writer's own budget frees
    if want > 0 and writer_after - need_own <= fair_share:
        for _, (held, entries) in sorted(others.items(), key=lambda item: -item[1][0]):
            excess = min(held - fair_share, want)
            if excess <= 0:
                continue
            picked = policy.victims(entries, excess)
            freed = sum(v.nbytes for v in picked)
            if freed > held - fair_share:  # never below its share: drop the entry that overshoots
                picked, freed = picked[:-1], freed - picked[-1].nbytes
            taken += picked
            want -= freed
            if want <= 0:
                break
    rest = max(need_own, need_tier - sum(v.nbytes for v in taken))
    mine = policy.victims(own, rest) if rest > 0 else []
    if sum(v.nbytes for v in mine) < rest:
        return None
    return taken + mine
