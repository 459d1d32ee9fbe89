"""``FsspecTier``: object storage and remote filesystems through fsspec (``s3://``, ``gs://``, ``file://``...).

Any protocol fsspec knows works (Alluxio through its fsspec package, once installed); the
backend's package must be installed (``pip install s3fs``, ``gcsfs``...).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec

from ragkv.cache.config import TierConfig
from ragkv.cache.keys import KEY_PATTERN
from ragkv.cache.tier import Tier
from ragkv.errors import RagkvError, StoreUnavailableError

__all__ = ["FsspecTier"]

logger = logging.getLogger(__name__)

_TEMP_PREFIX = ".tmp-"
_BOOLS = {"true": True, "false": False}


def _storage_option(value: str) -> Any:
    # Query strings carry text; fsspec backends want real booleans and numbers (anon=true).
    if value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    with contextlib.suppress(ValueError):
        return int(value)
    with contextlib.suppress(ValueError):
        return float(value)
    return value


class FsspecTier(Tier):
    """Values as objects ``<root>/<namespace>/<digest[:2]>/<digest>``.

    URL: ``s3://bucket/kv?endpoint_url=http://127.0.0.1:9000&anon=false``; query options other
    than ragkv's (``write``, ``timeout``) are fsspec storage options.

    Writes are atomic: the value goes to a hidden temporary name in the same directory and is
    then renamed into place, so readers see the old object or the whole new one, never part of
    one. Object stores whose single PUT is already all-or-nothing (S3, GCS, Azure) skip the
    temporary: their rename is a server-side copy that would double the write.
    """

    accepts: ClassVar[frozenset[str]] = frozenset({"writable", "timeout"})
    takes_backend_options: ClassVar[bool] = True
    default_timeout: ClassVar[float | None] = 30.0
    # An object on these appears only once its upload completed.
    atomic_put_protocols: ClassVar[frozenset[str]] = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        options = {name: _storage_option(value) for name, value in config.options}
        try:
            self._fs, root = fsspec.core.url_to_fs(config.location, **options)
        except ImportError as e:
            raise ImportError(
                f"the {config.scheme}:// tier needs its fsspec backend: {e} (e.g. pip install 'ragkv[s3]')"
            ) from e
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad fsspec URL or option for {config.display_url}: {e}") from e
        self._root = root.rstrip("/")
        protocols = self._fs.protocol if isinstance(self._fs.protocol, tuple) else (self._fs.protocol,)
        self._rename_to_commit = not (set(protocols) & self.atomic_put_protocols)

    def path(self, key: str) -> str:
        """Where ``key``'s object lives."""
        namespace, digest = key.split("/")
        return f"{self._root}/{namespace}/{digest[:2]}/{digest}"

    def _get(self, key: str) -> bytes | None:
        with self._translate("get"):
            try:
                return bytes(self._fs.cat_file(self.path(key)))
            except FileNotFoundError:
                return None

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        paths = {self.path(k): k for k in keys}
        with self._translate("get_many"):
            # Async backends (s3fs, gcsfs) fetch these concurrently.
            found = self._fs.cat(list(paths), on_error="omit")
        if isinstance(found, bytes):  # one path: fsspec returns the bytes themselves
            found = {next(iter(paths)): found}
        return {paths[p]: bytes(v) for p, v in found.items() if p in paths}

    def _put(self, key: str, value: bytes, cost: float | None) -> bool:
        path = self.path(key)
        with self._translate("put"):
            if not self._rename_to_commit:
                self._fs.pipe_file(path, value)
                return True
            parent = posixpath.dirname(path)
            temp = f"{parent}/{_TEMP_PREFIX}{uuid.uuid4().hex}"
            self._fs.makedirs(parent, exist_ok=True)
            try:
                self._fs.pipe_file(temp, value)
                self.commit(temp, path)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._fs.rm_file(temp)
                raise
        return True

    def commit(self, temp: str, path: str) -> None:
        """Rename a fully written temporary object into place (atomic on POSIX filesystems)."""
        self._fs.mv(temp, path)

    def _delete(self, key: str) -> bool:
        path = self.path(key)
        with self._translate("delete"):
            if not self._fs.exists(path):
                return False
            try:
                self._fs.rm_file(path)
            except FileNotFoundError:
                return False
            return True

    def _contains(self, key: str) -> bool:
        with self._translate("contains"):
            return bool(self._fs.exists(self.path(key)))

    def _keys(self, namespace: str) -> Iterator[str]:
        with self._translate("keys"):
            try:
                paths = self._fs.find(f"{self._root}/{namespace}")
            except FileNotFoundError:
                paths = []
        # Temporaries of writers still at work (or killed mid-write) never match a key.
        keys = (f"{namespace}/{posixpath.basename(p)}" for p in paths)
        return iter(sorted(k for k in keys if KEY_PATTERN.fullmatch(k)))

    @contextlib.contextmanager
    def _translate(self, op: str) -> Iterator[None]:
        """Turn backend failures into StoreUnavailableError at the tier boundary.

        fsspec backends raise their own exception types (botocore, aiohttp, OSError...), so
        anything that is not ragkv's own error counts as the tier being unavailable.
        """
        try:
            yield
        except RagkvError:
            raise
        except Exception as e:
            raise StoreUnavailableError(f"fsspec tier {self.name}: {op} failed: {e!r}") from e
