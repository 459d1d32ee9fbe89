"""Chunk precompute on a Ray cluster: actors that load the model once, write caches to the shared store.

The driver plans (chunks, skips what is stored) and commits (catalog, then FAISS) exactly as the
single-process path does (:meth:`KVRetriever.index_documents`); only the prefill + encode + store
of each chunk runs here, in Ray actors. Each actor loads the model once, writes the encoded caches
straight to the store's shared tiers and returns small records (keys, sizes). Fault tolerance is
Ray's: a dead actor is restarted (``max_restarts``) and its chunks retried (``max_task_retries``,
exceptions included); a chunk that still fails comes back as a failed result, and the rest land.

Ray is an optional extra (``pip install 'ragkv[ray]'``), imported on first use.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.retriever.kv_retriever import KVRetriever
from ragkv.retriever.precompute import ChunkComputer, ChunkResult, ComputeFn
from ragkv.retriever.transforms import TransformConfig
from ragkv.types import CodecSpec

logger = logging.getLogger(__name__)

__all__ = ["RayConfig", "WorkerSpec", "ChunkWorker", "ray_compute", "check_store_reach"]

# tiers that live inside one process or on one machine's disk; every other scheme is taken as shared
_PROCESS_SCHEMES = ("memory",)
_MACHINE_SCHEMES = ("disk", "file")


@dataclass(frozen=True, slots=True)
class RayConfig:
    """How chunk precompute runs on Ray."""

    address: str | None = (
        None  # Ray address ("auto", "ray://host:10001"); None: RAY_ADDRESS, a running local one, or a new one
    )
    actors: int | None = None  # None: one per GPU where the cluster has GPUs, else one per cpus_per_actor CPUs
    cpus_per_actor: int = 1  # CPUs reserved per actor, and its torch threads
    gpus_per_actor: float | None = None  # None: 1 where the cluster has GPUs, else 0
    max_restarts: int = 4  # times Ray restarts a dead actor
    max_task_retries: int = 2  # times Ray retries a chunk whose actor died or which raised
    in_flight: int = 2  # chunks queued per actor (keeps it busy while the driver commits)

    def __post_init__(self) -> None:
        for name in ("cpus_per_actor", "in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.actors is not None and (isinstance(self.actors, bool) or self.actors < 1):
            raise ValueError(f"actors must be an integer >= 1 or None (one per GPU or CPU slot); got {self.actors!r}")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything an actor needs to compute chunk caches the driver's way (picklable, small)."""

    model: str  # alias, local path or .gguf file, loaded once per actor
    store: tuple[str, ...]  # tier URLs the actor writes to
    tenant: str
    store_secret: bytes | None
    prefix_ids: tuple[int, ...]
    codecs: tuple[CodecSpec, ...]
    model_fingerprint: str  # the driver's: an actor whose model differs refuses to compute
    tokenizer_fingerprint: str
    threads: int = 1
    # The driver's resolved dtype ("bfloat16", not "auto"): a worker on a CPU without native bf16
    # would otherwise pick fp32, compute other caches and be refused by the fingerprint check.
    dtype: str = "float32"
    # which codecs are coded in the channel transform (the driver stores the transform before any
    # actor runs; actors read it from the shared store)
    transform: TransformConfig = TransformConfig(levels=())

    @classmethod
    def for_retriever(cls, retriever: KVRetriever, model: str, store: Sequence[str], threads: int = 1) -> WorkerSpec:
        """The spec that makes actors compute exactly what ``retriever`` would, into ``store``'s shared tiers."""
        computer = retriever.computer
        return cls(
            model=model,
            # a memory tier inside an actor would only hold copies nobody reads
            store=tuple(u for u in store if _scheme(u) not in _PROCESS_SCHEMES),
            tenant=computer.tenant,
            store_secret=computer.store_secret,
            prefix_ids=computer.prefix_ids,
            codecs=computer.codecs,
            model_fingerprint=retriever.adapter.fingerprint,
            tokenizer_fingerprint=retriever.adapter.tokenizer_fingerprint,
            threads=threads,
            dtype=str(retriever.adapter.dtype).removeprefix("torch."),
            transform=computer.transform_config,
        )


class ChunkWorker:
    """A Ray actor's body: the model, loaded once, and the store; computes one chunk per call."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        from ragkv.cache.store import open_store
        from ragkv.model import load_model

        torch.set_num_threads(spec.threads)
        adapter = load_model(spec.model, dtype=spec.dtype)
        got = (adapter.fingerprint, adapter.tokenizer_fingerprint)
        if got != (spec.model_fingerprint, spec.tokenizer_fingerprint):
            raise ValueError(
                f"the model {spec.model!r} loaded on this worker differs from the driver's (fingerprints {got} vs "
                f"{(spec.model_fingerprint, spec.tokenizer_fingerprint)}); give every node the same model files"
            )
        self.store = open_store(list(spec.store))
        self.computer = ChunkComputer(
            adapter,
            self.store,
            spec.prefix_ids,
            spec.codecs,
            tenant=spec.tenant,
            store_secret=spec.store_secret,
            transform=spec.transform,
        )

    def compute(self, token_ids: tuple[int, ...]) -> ChunkResult:
        """Prefill, encode and store one chunk's caches (unless stored); the small result goes to the driver."""
        return self.computer.ensure_stored(token_ids)

    def pid(self) -> int:
        import os

        return os.getpid()


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "disk"


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("indexing on Ray needs the ray package: pip install 'ragkv[ray]'") from e
    return ray


def check_store_reach(store: Sequence[str], nodes: int) -> None:
    """Refuse a store the workers cannot share: no tier outside a process, or one machine's disk on many.

    Args:
        store: the tier URLs the workers write to.
        nodes: live nodes in the Ray cluster.

    Raises:
        ValueError: saying which shared tier to configure.
    """
    hint = "add a shared tier, e.g. --store redis://HOST:6379/0 or s3://BUCKET/PREFIX (or RAGKV_STORE)"
    schemes = [_scheme(u) for u in store]
    if all(s in _PROCESS_SCHEMES for s in schemes):
        raise ValueError(f"indexing on Ray needs a store tier outside one process (memory:// is not shared); {hint}")
    if nodes > 1 and all(s in _PROCESS_SCHEMES + _MACHINE_SCHEMES for s in schemes):
        raise ValueError(
            f"the Ray cluster has {nodes} nodes but the store {list(store)} is memory and local disk only, "
            f"which the other nodes cannot reach; {hint}"
        )


def ray_compute(spec: WorkerSpec, config: RayConfig | None = None) -> ComputeFn:
    """A :data:`ComputeFn` that runs each chunk's precompute in Ray actors.

    Connects to Ray (``config.address``) on first use unless this process already did; a Ray it
    started is shut down when the run ends.
    """
    cfg = config or RayConfig()

    def compute(segments: Sequence[tuple[int, ...]]) -> Iterator[tuple[int, ChunkResult]]:
        if not segments:
            return
        check_store_reach(spec.store, 1)  # before starting anything
        ray = _ray()
        started = not ray.is_initialized()
        if started:
            ray.init(address=cfg.address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            check_store_reach(spec.store, len([n for n in ray.nodes() if n.get("Alive")]))
            actors = _start_actors(ray, spec, cfg, len(segments))
            try:
                yield from _dispatch(ray, actors, segments, cfg.in_flight)
            finally:
                for actor in actors:
                    ray.kill(actor)
        finally:
            if started:
                ray.shutdown()

    return compute


def _start_actors(ray: Any, spec: WorkerSpec, cfg: RayConfig, work: int) -> list[Any]:
    """One actor per GPU (or per ``cpus_per_actor`` CPUs), no more than there are chunks."""
    resources = ray.cluster_resources()
    gpus = cfg.gpus_per_actor if cfg.gpus_per_actor is not None else (1.0 if resources.get("GPU", 0) >= 1 else 0.0)
    if cfg.actors is not None:
        n = cfg.actors
    elif gpus > 0:
        n = int(resources.get("GPU", 0) // gpus)
    else:
        n = int(resources.get("CPU", 1) // cfg.cpus_per_actor)
    n = max(1, min(n, work))
    remote = ray.remote(ChunkWorker).options(
        num_cpus=cfg.cpus_per_actor,
        num_gpus=gpus,
        max_restarts=cfg.max_restarts,
        max_task_retries=cfg.max_task_retries,
    )
    logger.info("starting %d Ray actors (%d CPUs, %g GPUs each)", n, cfg.cpus_per_actor, gpus)
    return [remote.remote(spec) for _ in range(n)]


def _dispatch(
    ray: Any, actors: list[Any], segments: Sequence[tuple[int, ...]], depth: int
) -> Iterator[tuple[int, ChunkResult]]:
    """Keep ``depth`` chunks queued on each live actor; yield each result as it lands."""
    queue = deque(range(len(segments)))
    live = list(actors)
    in_flight: dict[Any, tuple[int, Any]] = {}  # object ref -> (chunk position, actor)

    def submit(actor: Any) -> None:
        i = queue.popleft()
        ref = actor.compute.options(retry_exceptions=True).remote(segments[i])
        in_flight[ref] = (i, actor)

    for _ in range(depth):
        for actor in live:
            if queue:
                submit(actor)
    while in_flight:
        [ref], _ = ray.wait(list(in_flight), num_returns=1)
        i, actor = in_flight.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as e:
            result = ChunkResult(computed=False, stored=False, error=_describe(e))
            logger.warning("chunk %d failed after Ray's retries: %s", i, result.error)
            if isinstance(e, ray.exceptions.RayActorError) and actor in live:
                live.remove(actor)  # restarts used up: its queued chunks fail too, new ones go elsewhere
        if queue and actor in live:
            submit(actor)
        elif queue and not live:
            while queue:  # every actor is dead for good
                yield queue.popleft(), ChunkResult(computed=False, stored=False, error="no live Ray actor left")
        yield i, result


def _describe(e: BaseException) -> str:
    """One line: the exception a task raised (not Ray's wrapper and traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
