"""ragkv.bench."""
