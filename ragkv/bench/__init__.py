"""The benchmarks behind ``ragkv bench`` (codec, fusion, store, assembly), printed by one table formatter."""
