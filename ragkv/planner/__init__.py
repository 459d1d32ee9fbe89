"""The load planner: per chunk, which stored level to load (or text to recompute) to meet a TTFT deadline."""
