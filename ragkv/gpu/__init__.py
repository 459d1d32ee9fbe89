"""The GPU data path: chunk caches kept on the device (the device tier), host ones staged layer by layer."""

from ragkv.gpu.feed import DeviceSink, LayerFeed, PinnedPool, pinned_pool
from ragkv.gpu.tier import DeviceTier, DeviceTierConfig, release

__all__ = ["DeviceSink", "DeviceTier", "DeviceTierConfig", "LayerFeed", "PinnedPool", "pinned_pool", "release"]
