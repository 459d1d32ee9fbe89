"""Where an engine keeps its data: the data directory, the catalog URL and the store's tier URLs.

Light on purpose (no torch, no transformers): the CLI resolves these to check its input (a missing
catalog, an empty index) before the modules that load models are imported, and ``EngineConfig``
takes its defaults from here, so they are written once.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_catalog_url", "default_data_dir", "default_store_urls"]


def default_data_dir() -> Path:
    """``RAGKV_DATA_DIR``, else the user's cache dir (``$XDG_CACHE_HOME/ragkv`` or ``~/.cache/ragkv``)."""
    env = os.environ.get("RAGKV_DATA_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ragkv"


def default_store_urls(data_dir: Path) -> list[str]:
    """The store when none is given: a bounded memory tier over a disk tier in ``data_dir``."""
    return ["memory://?max_bytes=536870912", str(data_dir / "kv")]


def default_catalog_url(data_dir: Path) -> str:
    """The catalog when none is given: a SQLite file in ``data_dir``."""
    return f"sqlite:///{data_dir / 'catalog.db'}"
