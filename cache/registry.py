"""The tier registry: URL scheme -> ``Tier`` class.

Built-in schemes map to ``"module:Class"`` strings imported on first use, so opening a memory
tier never imports redis-py. A scheme that is not registered but that fsspec knows (``s3``,
``gs``, ``file``, ``alluxiofs`` once installed...) opens an ``FsspecTier``.

>>> tier_class("memory").__name__
'MemoryTier'
>>> tier_class("s3").__name__
'FsspecTier'
"""

from __future__ import annotations

from ragkv.cache._lazy import load_target
from ragkv.cache.config import TierConfig
from ragkv.cache.tier import Tier

__all__ = ["open_tier", "register_tier", "tier_class", "tier_schemes"]

_TIERS: dict[str, type[Tier] | str] = {
    "memory": "ragkv.cache.memory:MemoryTier",
    "disk": "ragkv.cache.disk:DiskTier",
    "redis": "ragkv.cache.redis_tier:RedisTier",
    "rediss": "ragkv.cache.redis_tier:RedisTier",
}
_FSSPEC_TIER = "ragkv.cache.fsspec_tier:FsspecTier"


def register_tier(scheme: str, tier: type[Tier] | str) -> None:
    """Make ``scheme://`` URLs open ``tier`` (a Tier subclass or ``"module:Class"``)."""
    if not scheme or not scheme.isascii() or scheme.lower() != scheme:
        raise ValueError(f"tier schemes are lowercase ASCII, got {scheme!r}")
    _TIERS[scheme] = tier


def tier_schemes() -> list[str]:
    """The schemes registered here (fsspec protocols work too and are not listed)."""
    return sorted(_TIERS)


def _fsspec_knows(scheme: str) -> bool:
    import fsspec

    return scheme in fsspec.available_protocols()


def tier_class(scheme: str) -> type[Tier]:
    """The Tier class that opens ``scheme://`` URLs.

    Raises:
        ValueError: neither registered here nor known to fsspec.
    """
    target: type[Tier] | str | None = _TIERS.get(scheme)
    if target is None and _fsspec_knows(scheme):
        target = _FSSPEC_TIER
    if target is None:
        raise ValueError(
            f"no storage tier for {scheme}://; use one of {tier_schemes()}, a plain path, or an fsspec "
            "protocol (install its package, e.g. s3fs)"
        )
    cls: type[Tier] = load_target(target) if isinstance(target, str) else target
    return cls


def open_tier(url: str | TierConfig) -> Tier:
    """Open the tier a URL (or a parsed ``TierConfig``) names.

    Raises:
        ValueError: unknown scheme or bad option.
        ImportError: the backend's package is missing (the message names it).
        StoreUnavailableError: the tier cannot be opened (e.g. an unwritable directory).
    """
    config = url if isinstance(url, TierConfig) else TierConfig.from_url(url)
    return tier_class(config.scheme)(config)
