"""ragkv.codec."""
