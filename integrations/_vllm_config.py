"""The vLLM connector's settings and the ragkv side built from them (no vLLM import: CI tests them).

A connector must make the keys the indexer made: same model, prefix, tenant, codecs and channel
transform (a key digests the transform a chunk was coded in, :mod:`ragkv.retriever.transforms`).
``kv_connector_extra_config`` therefore takes the indexer's ``codec``, ``index_codecs`` and
``transform_levels`` besides ``EngineConfig``'s fields; :func:`build_side` turns the settings into a
:class:`~ragkv.integrations._vllm_core.RagkvSide` over an open store and catalog.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ragkv.integrations._vllm_core import RagkvSide

if TYPE_CHECKING:
    from ragkv.cache.catalog import Catalog
    from ragkv.cache.store import TieredStore
    from ragkv.config import EngineConfig
    from ragkv.model import ModelAdapter
    from ragkv.types import CodecSpec

__all__ = [
    "CONNECTOR_SETTINGS",
    "DEFAULT_LOAD_TIMEOUT_S",
    "KNOWN_SETTINGS",
    "ConnectorOptions",
    "build_side",
    "connector_options",
    "engine_config",
    "parse_codec",
]

_ENGINE_FIELDS = ("catalog", "tenant", "data_dir", "model", "dtype", "device")
# the connector's own settings (RagkvConnector reads them; not part of the keys)
CONNECTOR_SETTINGS = frozenset({"load_async", "fusion_threads", "load_timeout_s"})
KNOWN_SETTINGS = frozenset(
    {
        "store",
        *_ENGINE_FIELDS,
        "fusion_method",
        "fusion_ratio",
        "codec",
        "index_codecs",
        "transform_levels",
        *CONNECTOR_SETTINGS,
    }
)


def parse_codec(text: str) -> CodecSpec:
    """A ``CodecSpec`` from ``"name:level"`` (``str(spec)``'s form).

    >>> parse_codec("cachegen:1")
    CodecSpec(name='cachegen', level=1)
    """
    from ragkv.types import CodecSpec

    name, sep, level = str(text).strip().partition(":")
    if not sep or not level.strip().isdigit():
        raise ValueError(f"a codec is written 'name:level', e.g. 'cachegen:1'; got {text!r}")
    return CodecSpec(name.strip(), int(level))


def _codecs(value: Any) -> tuple[CodecSpec, ...]:
    items = value.split(",") if isinstance(value, str) else value
    return tuple(parse_codec(v) for v in items if str(v).strip())


def _levels(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise ValueError(f"transform_levels takes a list of codec levels ([] for off); got {value!r}")
    out = []
    for v in items:
        if isinstance(v, bool) or not str(v).strip().isdigit():
            raise ValueError(f"transform_levels takes codec levels >= 0 ([] for off); got {value!r}")
        out.append(int(v))
    return tuple(out)


def engine_config(model: str, extra: Mapping[str, Any]) -> EngineConfig:
    """ragkv's settings from the connector's extra config (over ``RAGKV_*``), model defaulting to vLLM's.

    ``codec`` (``"cachegen:1"``), ``index_codecs`` and ``transform_levels`` must be the indexer's
    ``RetrieverConfig.codec``, ``index_codecs`` and ``transform.levels``: they decide the keys.

    Raises:
        ValueError: an unknown setting, or one written wrong (the message names the form).
    """
    from ragkv.engine import EngineConfig
    from ragkv.fusion import FusionConfig

    unknown = set(extra) - KNOWN_SETTINGS
    if unknown:
        raise ValueError(
            f"unknown ragkv settings in kv_connector_extra_config: {sorted(unknown)}; known: {sorted(KNOWN_SETTINGS)}"
        )
    over = {k: v for k, v in extra.items() if k in _ENGINE_FIELDS}
    if "store" in extra:
        store = extra["store"]
        over["store"] = tuple(u.strip() for u in store.split(",")) if isinstance(store, str) else tuple(store)
    over.setdefault("model", model)
    over.setdefault("device", "cpu")
    cfg = EngineConfig.from_env(**over)
    if "fusion_method" in extra or "fusion_ratio" in extra:
        fusion = FusionConfig(
            method=str(extra.get("fusion_method", cfg.fusion.method)),
            ratio=float(extra.get("fusion_ratio", cfg.fusion.ratio)),
        )
        cfg = replace(cfg, fusion=fusion)
    retriever = cfg.retriever
    if "codec" in extra:
        retriever = replace(retriever, codec=parse_codec(extra["codec"]))
    if "index_codecs" in extra:
        retriever = replace(retriever, index_codecs=_codecs(extra["index_codecs"]))
    if "transform_levels" in extra:
        retriever = replace(
            retriever, transform=replace(retriever.transform, levels=_levels(extra["transform_levels"]))
        )
    return replace(cfg, retriever=retriever)


def _flag(name: str, value: Any) -> bool:
    from ragkv.cache.config import parse_bool

    if isinstance(value, bool):
        return value
    try:
        return parse_bool(str(value))
    except ValueError:
        raise ValueError(f"{name} takes true or false; got {value!r}") from None


# A load that takes longer is given up: its blocks are reported failed and vLLM computes them. The
# slowest fusion measured (Qwen2.5 1.5B, fp32 on 2 CPU cores, a 1.5K-token context) took 9-12 s;
# a minute leaves five times that, and a store that hangs stalls vLLM's steps no longer than that.
DEFAULT_LOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """The connector's own settings (not part of the chunk keys); see :func:`connector_options`."""

    load_async: bool = False
    fusion_threads: int | None = None  # None: every CPU the process may run on
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # 0: no limit


def connector_options(extra: Mapping[str, Any]) -> ConnectorOptions:
    """The connector's own settings from its extra config.

    ``load_async`` (default false): true reports the served tokens as loading asynchronously, so vLLM
    keeps stepping its other requests while ragkv fuses, and learns of the end through
    ``get_finished``; false fuses within the step, before its forward pass. Measured on 2 CPU cores
    (docs/benchmarks.md, "vLLM connector"), the overlap costs more than it saves: fusion and vLLM's
    forward contend for the same cores. ``fusion_threads`` (default: every CPU this process may run
    on): torch's intra-op threads while ragkv fuses (vLLM's CPU worker pins torch to fewer).
    ``load_timeout_s`` (default 60, 0 = no limit): a load still fusing after that long is given up:
    its blocks are reported failed, vLLM computes them, and the fusion's result is never written.

    Raises:
        ValueError: a value written wrong (the message names the form).
    """
    load_async = _flag("load_async", extra.get("load_async", False))
    threads = extra.get("fusion_threads")
    if threads is not None and (isinstance(threads, bool) or not str(threads).strip().isdigit() or int(threads) < 1):
        raise ValueError(f"fusion_threads takes an integer >= 1 (torch threads while fusing); got {threads!r}")
    timeout = extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(timeout, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"load_timeout_s takes seconds >= 0 (0 = no limit); got {timeout!r}")
    return ConnectorOptions(load_async, None if threads is None else int(threads), seconds)


def build_side(adapter: ModelAdapter, store: TieredStore, catalog: Catalog, cfg: EngineConfig) -> RagkvSide:
    """The connector's ragkv side: ``adapter`` (the indexer's model), the store and catalog, keyed as ``cfg`` says.

    Its chunk keys digest the channel transform the store holds for the model and tenant (read,
    never calibrated here: a missing, damaged or foreign one makes the chunks coded in it misses).
    """
    from ragkv.retriever.precompute import ChunkComputer, StoredEntry, record_stored

    prefix_ids = adapter.encode(adapter.layout(cfg.retriever.system).prefix)
    computer = ChunkComputer(
        adapter,
        store,
        prefix_ids,
        cfg.retriever.stored_codecs,
        tenant=cfg.tenant,
        store_secret=cfg.store_secret,
        transform=cfg.retriever.transform,
    )
    seen: set[int] = set()

    def new_texts() -> list[str]:
        rows = [r for r in catalog.all_chunk_rows(cfg.tenant) if r not in seen]
        seen.update(rows)
        return [c.text for c in catalog.chunks_by_rows(rows, cfg.tenant)]

    def record(entry: StoredEntry) -> None:
        record_stored(catalog, entry, tenant=cfg.tenant)

    return RagkvSide(
        adapter, computer, cfg.retriever.codec, cfg.fusion, new_texts, system=cfg.retriever.system, record=record
    )
