"""ragkv.cache."""
