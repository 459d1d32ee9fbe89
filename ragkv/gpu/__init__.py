"""The GPU data path: decoded chunk caches kept on the device and in pinned host memory (the device and
host tiers), host ones staged layer by layer."""

from ragkv.gpu.feed import DeviceSink, LayerFeed, PinnedPool, pinned_pool
from ragkv.gpu.host_tier import HostTier, HostTierConfig
from ragkv.gpu.tier import DeviceTier, DeviceTierConfig, release

__all__ = [
    "DeviceSink",
    "DeviceTier",
    "DeviceTierConfig",
    "HostTier",
    "HostTierConfig",
    "LayerFeed",
    "PinnedPool",
    "pinned_pool",
    "release",
]
