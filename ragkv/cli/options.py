"""Options the ``ragkv`` commands share, declared once, and the EngineConfig they build."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["CatalogUrl", "DataDir", "Device", "Dtype", "Fusion", "MaxNewTokens", "Model", "Offline", "Ratio",
           "SloMs", "Store", "Tenant", "config_from", "engine_config"]  # fmt: skip

# Options default to None ("not given"): EngineConfig and its component records hold the defaults,
# written once; the CLI only overrides what the user typed (or what RAGKV_* variables set).
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Index and cache directory [env RAGKV_DATA_DIR].")]
Model = Annotated[
    str | None,
    typer.Option("--model", help="Model alias, local path, .gguf file or hub name [env RAGKV_MODEL; smollm2-135m]."),
]
Store = Annotated[str | None, typer.Option("--store", help="Tier URLs, comma-separated [env RAGKV_STORE].")]
CatalogUrl = Annotated[str | None, typer.Option("--catalog", help="SQLAlchemy URL [env RAGKV_CATALOG].")]
Tenant = Annotated[
    str | None, typer.Option("--tenant", help="Namespace of index and cache entries [env RAGKV_TENANT; default].")
]
Fusion = Annotated[
    str | None,
    typer.Option(
        "--fusion", help="Fusion method: naive, full, blend or query_focus (the default); see docs/concepts.md."
    ),
]
Ratio = Annotated[float | None, typer.Option("--ratio", help="Share of chunk tokens to recompute.")]
Dtype = Annotated[
    str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16 [env RAGKV_DTYPE; auto].")
]
Device = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda[:N] or mps [env RAGKV_DEVICE; auto].")]
Offline = Annotated[bool | None, typer.Option("--offline", help="Never download a hub model (like HF_HUB_OFFLINE=1).")]
MaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", help="Cap on answer tokens [128].")]
SloMs = Annotated[
    float | None,
    typer.Option("--slo-ms", help="TTFT deadline in ms: chunk caches load at cheaper levels or as text to meet it."),
]


def engine_config(
    data_dir: Path | None = None,
    model: str | None = None,
    store: str | None = None,
    catalog: str | None = None,
    tenant: str | None = None,
    fusion: str | None = None,
    ratio: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    offline: bool | None = None,
    slo_ms: float | None = None,
) -> Any:
    """EngineConfig from its defaults, then RAGKV_* variables, then the options the user gave."""
    from dataclasses import replace

    from ragkv.engine import EngineConfig

    cfg = EngineConfig.from_env(
        data_dir=data_dir,
        model=model,
        store=None if store is None else tuple(u.strip() for u in store.split(",") if u.strip()),
        catalog=catalog,
        tenant=tenant,
        dtype=dtype,
        device=device,
        offline=offline or None,
    )
    if fusion is not None:
        cfg = replace(cfg, fusion=replace(cfg.fusion, method=fusion))
    if ratio is not None:
        cfg = replace(cfg, fusion=replace(cfg.fusion, ratio=ratio))
    if top_k is not None:
        cfg = replace(cfg, retriever=replace(cfg.retriever, top_k=top_k))
    if max_new_tokens is not None:
        cfg = replace(cfg, generation=replace(cfg.generation, max_new_tokens=max_new_tokens))
    if slo_ms is not None:
        cfg = replace(cfg, load=replace(cfg.load, slo_ms=slo_ms))
    return cfg


def config_from(ctx: typer.Context) -> Any:
    """:func:`engine_config` from the engine options a command was given (its other parameters are
    its own): a command declares the shared options in its signature and passes them on in one call."""
    import inspect

    names = inspect.signature(engine_config).parameters
    return engine_config(**{k: v for k, v in ctx.params.items() if k in names})
