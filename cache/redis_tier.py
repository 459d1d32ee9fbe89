"""``RedisTier``: a Redis server shared by many processes and machines (``redis://``, ``rediss://``)."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import ClassVar, cast
from urllib.parse import urlencode

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ragkv.cache.config import TierConfig
from ragkv.cache.keys import KEY_PATTERN
from ragkv.cache.tier import Tier
from ragkv.errors import StoreUnavailableError

__all__ = ["RedisTier"]

_GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")


class RedisTier(Tier):
    """Values in Redis under ``<prefix><namespace>/<digest>`` (prefix ``ragkv:`` by default).

    URL: ``redis[s]://[user:password@]host:port/db?ttl=86400&timeout=2&prefix=ragkv:``; other
    query options go to redis-py (e.g. ``ssl_cert_reqs=none``, ``health_check_interval=30``).

    Every call is bounded by ``timeout`` (connect and socket timeouts, one immediate retry for a
    stale pooled connection). ``get_many`` sends pipelined MGETs. Memory limits and eviction are
    the server's (``maxmemory``, ``maxmemory-policy allkeys-lru``); note that the server's
    eviction does not know tenants, and ``stats()`` reports no entries or bytes (that would
    need a scan).
    """

    accepts: ClassVar[frozenset[str]] = frozenset({"writable", "timeout", "ttl"})
    takes_backend_options: ClassVar[bool] = True
    default_timeout: ClassVar[float | None] = 2.0
    mget_batch: ClassVar[int] = 64  # keys per MGET; a pipeline sends all batches in one round trip

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        options = config.option_dict()
        self._prefix = options.pop("prefix", "ragkv:")
        # redis-py would accept unknown options here and fail on the first command instead.
        unknown = set(options) - set(inspect.signature(redis.Redis.__init__).parameters)
        if unknown or "decode_responses" in options:  # values are bytes, never text
            raise ValueError(f"bad Redis URL {config.display_url}: unsupported option(s) {sorted(options)}")
        url = f"{config.location}?{urlencode(options)}" if options else config.location
        try:
            # URL options win over these keyword defaults (redis-py merges them that way).
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                retry=Retry(NoBackoff(), 1),
                health_check_interval=30,
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad Redis URL {config.display_url}: {e}") from e

    def _name(self, key: str) -> str:
        return self._prefix + key

    def _get(self, key: str) -> bytes | None:
        with self._translate("get"):
            value = self._client.get(self._name(key))
        return None if value is None else cast(bytes, value)

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        batches = [keys[i : i + self.mget_batch] for i in range(0, len(keys), self.mget_batch)]
        with self._translate("get_many"):
            pipe = self._client.pipeline(transaction=False)
            for batch in batches:
                pipe.mget([self._name(k) for k in batch])
            replies = pipe.execute()
        found: dict[str, bytes] = {}
        for batch, values in zip(batches, replies, strict=True):
            found.update({k: v for k, v in zip(batch, values, strict=True) if v is not None})
        return found

    def _put(self, key: str, value: bytes, cost: float | None) -> bool:
        ttl_ms = int(self.config.ttl * 1000) if self.config.ttl is not None else None
        with self._translate("put"):
            return bool(self._client.set(self._name(key), value, px=ttl_ms))

    def _delete(self, key: str) -> bool:
        with self._translate("delete"):
            return bool(self._client.delete(self._name(key)))

    def _contains(self, key: str) -> bool:
        with self._translate("contains"):
            return bool(self._client.exists(self._name(key)))

    def _keys(self, namespace: str) -> Iterator[str]:
        pattern = _GLOB_SPECIALS.sub(r"\\\1", self._prefix) + namespace + "/*"
        with self._translate("keys"):
            names = list(self._client.scan_iter(match=pattern, count=1000))
        start = len(self._prefix)
        keys = (bytes(n).decode("utf-8", "replace")[start:] for n in names)
        return iter(sorted(k for k in keys if KEY_PATTERN.fullmatch(k)))

    def _close(self) -> None:
        self._client.close()

    @contextlib.contextmanager
    def _translate(self, op: str) -> Iterator[None]:
        """Turn redis-py failures into StoreUnavailableError at the tier boundary."""
        try:
            yield
        except redis.RedisError as e:
            raise StoreUnavailableError(f"redis tier {self.name}: {op} failed: {e}") from e
