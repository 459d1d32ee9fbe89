"""ragkv.cache: stored chunk KV as bytes, across tiers, plus the catalog.

This package moves bytes; it never imports torch (``ragkv.codec`` turns tensors into bytes).

* :class:`TieredStore` / :func:`open_store`: tiers stacked fastest first, read down with
  promotion, written through, failing soft (``open_store("memory://,/var/cache/kv,redis://h")``);
* :class:`Tier` and its registry (:func:`open_tier`, :func:`register_tier`): ``memory://``,
  ``disk:///path`` or a plain path, ``redis://`` / ``rediss://``, and any fsspec protocol
  (``file://``, ``s3://``, ``gs://``...);
* :class:`Catalog`: documents, chunks and stored entries in SQLite or PostgreSQL.

Backends (redis-py, fsspec, diskcache, SQLAlchemy) are imported only by the modules that use
them; importing this package imports the store and the catalog's records, not the backends.
"""

from ragkv.cache.breaker import CircuitBreaker
from ragkv.cache.config import TierConfig
from ragkv.cache.document_record import DocumentRecord
from ragkv.cache.entry_record import EntryRecord
from ragkv.cache.policy import EvictionPolicy, policy_for, register_policy
from ragkv.cache.registry import open_tier, register_tier, tier_class
from ragkv.cache.stats import TierStats
from ragkv.cache.store import TieredStore, open_store
from ragkv.cache.store_config import StoreConfig
from ragkv.cache.tier import Tier

__all__ = [
    "Catalog",
    "CircuitBreaker",
    "DocumentRecord",
    "EntryRecord",
    "EvictionPolicy",
    "StoreConfig",
    "Tier",
    "TierConfig",
    "TierStats",
    "TieredStore",
    "open_store",
    "open_tier",
    "policy_for",
    "register_policy",
    "register_tier",
    "tier_class",
]


def __getattr__(name: str) -> object:
    # The catalog pulls in SQLAlchemy; import it only when asked for.
    if name == "Catalog":
        from ragkv.cache.catalog import Catalog

        return Catalog
    raise AttributeError(f"module 'ragkv.cache' has no attribute {name!r}")
