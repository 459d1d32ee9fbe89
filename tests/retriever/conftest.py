"""Server fixtures shared with the cache tests (skip locally, fail under CI)."""

from tests.cache.conftest import postgres_server, postgres_url, redis_server, redis_url  # noqa: F401
