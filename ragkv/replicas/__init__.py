"""ragkv serve past one process: Ray Serve replicas, and a router sending each request to its chunks."""
