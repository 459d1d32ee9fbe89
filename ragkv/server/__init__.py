"""The server room: ragkv serve, an OpenAI-compatible HTTP server with batched generation."""
