"""ChunkLoader: the query path's side of the store: chunk caches loaded, checked and decoded.

Indexing (:class:`~ragkv.retriever.kv_retriever.KVRetriever`) writes chunk caches through a
:class:`~ragkv.retriever.precompute.ChunkComputer`; the loader reads them back through the same
computer (its keys, its prefix cache, its ``put`` for a miss) and the catalog (stored sizes for the
planner, hits touched, recomputed entries recorded). That is the whole interface between the two.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ragkv import codec
from ragkv.cache.catalog import Catalog
from ragkv.cache.fetched import Fetched
from ragkv.errors import CodecError
from ragkv.gpu.feed import DeviceSink
from ragkv.gpu.host_tier import HostTier
from ragkv.gpu.tier import DeviceTier
from ragkv.planner.plan import LOCAL, TEXT, ChunkOptions
from ragkv.planner.session import LoadPlanning, LoadSession
from ragkv.retriever.decoding import OrderedDecodes, default_workers
from ragkv.retriever.precompute import ChunkComputer, record_stored
from ragkv.retriever.prefetch import prefetch
from ragkv.types import ChunkKey, ChunkKV, CodecSpec

logger = logging.getLogger(__name__)

__all__ = ["ChunkLoader", "LoadedChunk", "expected_blob"]


def expected_blob(key: ChunkKey, arch: Any, num_tokens: int, secret: bytes | None) -> codec.Expected:
    """What a stored chunk cache must be to be used for ``key``: from the key and the loaded model's
    ``arch`` (its ``ArchSpec``), never from the stored bytes."""
    return codec.Expected(
        key=key.storage_key,
        model_fingerprint=key.model_fingerprint,
        spec=key.codec,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        num_tokens=num_tokens,
        secret=secret,
    )


@dataclass(frozen=True, slots=True)
class LoadedChunk:
    """A chunk's cache as the query path gets it."""

    kv: ChunkKV
    hit: bool  # True: loaded from the store; False: computed now (and stored)
    nbytes: int  # encoded bytes read (hits) or written (misses)
    recompute: bool = False  # True: not loaded (planned as text, or its tier failed); kv is a placeholder
    local: bool = False  # True: stored, but prefilled here while other chunks were fetched (planned LOCAL)
    device: bool = False  # True: a device-tier hit (on the model's device; nothing read from the store)
    host: bool = False  # True: a host-tier hit (decoded, in pinned host memory; nothing read from the store)
    sink: DeviceSink | None = None  # a device-tier entry fusion fills as this (host) chunk lands


class ChunkLoader:
    """Loads chunk caches for the query path; a missing, damaged or foreign entry is recomputed and stored.

    Args:
        computer: keys, the prefix cache, the model and the store (shared with indexing).
        catalog: the catalog the entries are recorded in.
        codec: the primary (codec, level) loaded without a plan.
        stored_codecs: every (codec, level) stored per chunk, best quality first (what a plan picks from).
        store_secret: MAC key material the entries were signed with (None: unauthenticated).
        device_tier: decoded chunk caches on the model's GPU, looked up first (None: none).
        host_tier: decoded chunk caches in pinned host memory, looked up after the device tier and
            before the store (None: none).
        decode_workers: threads that decode a request's chunks side by side (1: on the query
            thread, one after another). None: half the cores, 1 to 8, for a model on a GPU; 1 for a
            model on the CPU, whose decodes would compete with torch's own threads for no measured
            gain (``ragkv.retriever.decoding``, docs/gpu.md "Decode threads").
    """

    def __init__(
        self,
        computer: ChunkComputer,
        catalog: Catalog,
        *,
        codec: CodecSpec,
        stored_codecs: Sequence[CodecSpec],
        store_secret: bytes | None = None,
        device_tier: DeviceTier | None = None,
        host_tier: HostTier | None = None,
        decode_workers: int | None = None,
    ) -> None:
        if decode_workers is not None and decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1 thread, got {decode_workers}")
        self.computer, self.catalog = computer, catalog
        self.adapter, self.store = computer.adapter, computer.store
        self.codec, self.stored_codecs = codec, tuple(stored_codecs)
        self.store_secret = store_secret
        self.device_tier, self.host_tier = device_tier, host_tier
        self.decode_workers = default_workers(self.adapter.device.type) if decode_workers is None else decode_workers

    def load(self, token_ids: Sequence[int]) -> LoadedChunk:
        """The chunk's cache: from the store, or computed now (and stored) on a miss."""
        return self.load_many([token_ids])[0]

    def load_many(self, segments: Sequence[Sequence[int]]) -> list[LoadedChunk]:
        """Several chunks' caches at the primary codec, in order (see :meth:`load_planned`)."""
        return self._load(segments, None)[0]

    def load_planned(
        self, segments: Sequence[Sequence[int]], plan: LoadPlanning
    ) -> tuple[list[LoadedChunk], dict[str, Any] | None]:
        """Like :meth:`load_many`, each chunk's (codec, level) chosen by ``plan``; with the load
        session's report (what was chosen and why; None when nothing was planned)."""
        return self._load(segments, plan)

    def _load(
        self, segments: Sequence[Sequence[int]], plan: LoadPlanning | None
    ) -> tuple[list[LoadedChunk], dict[str, Any] | None]:
        """Several chunks' caches, in order; misses and unusable entries are computed and stored.

        With more than one chunk, blobs are fetched on a background thread, in order, while the
        main thread decodes the ones already fetched: chunk i+1 loads from its tier while chunk i
        decodes, so a remote tier's latency hides behind decoding. With ``decode_workers`` > 1 the
        fetched chunks decode side by side on the shared decode threads, their results taken back
        in order (``ragkv.retriever.decoding``). Only the fetch thread touches
        the store until every fetch is done; the misses are then computed and stored, and the
        hits' catalog entries touched in one write. A chunk that occurs twice is fetched once; its
        repeat counts as a hit of 0 bytes (its cache was loaded or computed for the first occurrence).

        With ``plan``, each chunk's (codec, level) is chosen just before it is fetched, on the speeds
        measured so far (see ``ragkv.planner``); a chunk planned as text, or whose tier fails
        mid-load (and every chunk after it), comes back with ``recompute=True`` and no bytes read:
        fusion computes it from its tokens. A chunk planned as ``LOCAL`` (under a deadline the
        link cannot meet) is prefilled on this thread when its turn comes, while the fetch thread
        reads the next chunks, and comes back with ``local=True`` (not stored again: the store has
        it). Without ``plan``, every chunk loads at ``config.codec``.
        """
        self.computer.ensure_transform(segments)  # read once per process (or recalibrated: keys then miss)
        keys = [self.computer.chunk_key(t, self.codec) for t in segments]
        first: dict[str, int] = {}  # storage key -> index of its first occurrence
        primary = [key.storage_key for key in keys]  # identifies the chunk (keys[i] may move to another level)
        for i, storage_key in enumerate(primary):
            first.setdefault(storage_key, i)
        # tier hits skip the store entirely: the device tier's first, then the host tier's
        on_device, on_host = self._tier_hits(keys, first, segments)
        unique = [i for i in first.values() if i not in on_device and i not in on_host]  # a repeat loads once
        session = None if plan is None else self._session([segments[i] for i in unique], plan)
        fixed = self.codec if plan is None or plan.config.fixed is None else plan.config.fixed

        planning = session is not None and plan is not None and plan.config.fixed is None

        def fetch(n: int) -> tuple[ChunkKey | None, Fetched | None]:
            """(key, bytes) read; (None, None): recompute in fusion; (key, None): prefill here."""
            i = unique[n]
            spec = fixed
            if planning and session is not None and session.chunks[n].sizes:  # chunks never stored: a miss
                chosen = session.choose(n)
                if chosen is TEXT:
                    return None, None
                if chosen == LOCAL:
                    return keys[i], None
                assert isinstance(chosen, CodecSpec)
                spec = chosen
            if spec != keys[i].codec:
                keys[i] = self.computer.chunk_key(segments[i], spec)
            if session is None:  # no tier bookkeeping needed: the plain read
                return keys[i], Fetched(self.store.get(keys[i].storage_key), None, 0.0, False)
            got = self.store.fetch(keys[i].storage_key)
            if not session.fetched(n, keys[i].codec, got):
                return None, None
            return keys[i], got

        sizes: dict[int, int | None] = {}  # bytes of each stored blob (None: not stored)
        decoded: dict[int, ChunkKV | None] = {}
        seconds: dict[int, float] = {}  # fetch + decode time of each hit (the device tier's cost)
        text: set[int] = set()  # chunks fusion recomputes from their tokens
        local: set[int] = set()  # chunks prefilled here while the next ones were fetched
        spans: list[tuple[float, float]] = []  # (start, end) of each decode
        decodes: OrderedDecodes[tuple[int, ChunkKey, Fetched, int], tuple[ChunkKV | None, float, float]]
        around = None  # decodes onto the GPU upload on the request's stream (see OrderedDecodes)
        if self.adapter.device.type == "cuda":
            around = functools.partial(torch.cuda.stream, torch.cuda.current_stream(self.adapter.device))
        decodes = OrderedDecodes(self.decode_workers, around=around)

        def landed(done: list[tuple[tuple[int, ChunkKey, Fetched, int], tuple[ChunkKV | None, float, float]]]) -> None:
            for (i, key, got, nbytes), (kv, start, end) in done:
                decoded[i] = kv
                seconds[i] = got.seconds + end - start
                spans.append((start, end))
                if session is not None and kv is not None:
                    session.decoded(key.codec, nbytes, end - start)

        # up to 3 ahead: a run of chunks prefilled here leaves room for the read after them to start
        with contextlib.closing(prefetch(range(len(unique)), fetch, ahead=3)) as fetched:
            try:
                for n, (key, got) in enumerate(fetched):
                    # the next chunks keep loading while this one decodes (on the decode threads
                    # with several, the chunks after it too); its bytes are dropped after
                    i = unique[n]
                    if key is not None and got is None and session is not None:  # planned LOCAL
                        started = time.perf_counter()
                        decoded[i] = self.adapter.prefill_kv(segments[i], past=[self.computer.prefix_kv()])
                        session.prefilled_here(n, len(segments[i]), time.perf_counter() - started)
                        local.add(i)
                        continue
                    if key is None or got is None:
                        text.add(i)
                        if session is not None:
                            session.recomputed(n)
                        continue
                    blob = got.value
                    sizes[i] = None if blob is None else len(blob)
                    if blob is None:
                        decoded[i] = None
                        seconds[i] = got.seconds
                        continue
                    call = functools.partial(self._timed_decode, key, len(segments[i]), blob)
                    landed(decodes.submit((i, key, got, len(blob)), call))
                landed(decodes.finish())
            finally:
                decodes.cancel()
        if session is not None and self.decode_workers > 1:
            session.decodes_overlapped(spans)
        done = self._finish_loads(segments, keys, unique, decoded, sizes, text, local)
        done.update({i: LoadedChunk(kv, True, 0, device=True) for i, kv in on_device.items()})
        done.update({i: LoadedChunk(kv, True, 0, host=True) for i, kv in on_host.items()})
        self._admit(done, keys, primary, seconds)
        out = []
        for i, storage_key in enumerate(primary):
            j = first[storage_key]
            # a repeat reuses the cache its first occurrence loaded or computed: nothing to prefill,
            # nothing read (or, when its first occurrence is recomputed from text, it is too)
            out.append(done[j] if i == j else replace(done[j], hit=not done[j].recompute, nbytes=0, sink=None))
        return out, (session.report() if session is not None else None)

    def _tier_hits(
        self, keys: Sequence[ChunkKey], first: dict[str, int], segments: Sequence[Sequence[int]]
    ) -> tuple[dict[int, ChunkKV], dict[int, ChunkKV]]:
        """The chunks the device tier holds at the primary codec, then those the host tier holds among
        the rest, by index (their catalog entries touched)."""
        a, device, host = self.adapter, self.device_tier, self.host_tier
        on_device: dict[int, ChunkKV] = {}
        on_host: dict[int, ChunkKV] = {}
        if device is None and host is None:
            return on_device, on_host
        for key, i in first.items():
            n = len(segments[i])
            kv = None if device is None else device.get(key, fingerprint=a.fingerprint, dtype=a.dtype, num_tokens=n)
            if kv is not None:
                on_device[i] = kv
                continue
            if host is None:
                continue
            # a host entry is what decoding gave: in the decode's dtype, not always the model's
            kv = host.get(key, fingerprint=a.fingerprint, dtype=self._decoded_dtype(keys[i]), num_tokens=n)
            if kv is not None:
                on_host[i] = kv
        if on_device or on_host:
            self.catalog.touch_entries([keys[i].storage_key for i in (*on_device, *on_host)])
        return on_device, on_host

    def _admit(
        self, done: dict[int, LoadedChunk], keys: list[ChunkKey], primary: Sequence[str], seconds: dict[int, float]
    ) -> None:
        """Offer the store hits loaded at the primary codec to the tiers (host-tier hits to the device tier).

        Only decoded entries go in (never a chunk computed here: a tier hit must fuse exactly as a
        store hit does). The host tier copies its entries on a worker thread, off this request's
        path (:meth:`HostTier.offer`). On the device tier, one decoded on the device is kept as it
        is; one on the host gets a sink that fusion fills as the chunk lands (``LoadedChunk.sink``).
        """
        tier, host = self.device_tier, self.host_tier
        if tier is None and host is None:
            return
        tenant = self.computer.tenant
        for i, loaded in list(done.items()):
            key = keys[i].storage_key
            if not loaded.hit or loaded.device or key != primary[i]:
                continue  # a miss, a device hit already, or another level than a lookup asks for
            if loaded.host and tier is None:
                continue  # in the host tier already, and no device tier to offer it to
            if host is not None and not loaded.host:
                # offered before the removal check: a removal after the check discards the copy
                # (a discard cancels a waiting admission), one before it is seen by the check
                host.offer(key, loaded.kv, seconds.get(i, 0.0))
            if self.catalog.is_removed(tenant, keys[i].tokens_digest):
                if host is not None:  # read just before its document's removal discarded the tiers' copies
                    host.discard(key)
                continue
            if tier is None:
                continue
            # a host hit's cost (0 here) is its DMA, hidden under the compute: cheap to bring back
            if loaded.kv.keys.device == tier.device:
                tier.put(key, loaded.kv, seconds.get(i, 0.0))
            elif (sink := tier.reserve(key, loaded.kv, self.adapter.dtype, seconds.get(i, 0.0))) is not None:
                done[i] = replace(loaded, sink=sink)

    def _session(self, segments: Sequence[Sequence[int]], plan: LoadPlanning) -> LoadSession:
        """A load session over ``segments``, with each one's stored sizes from the catalog."""
        order = self.stored_codecs
        keyed = [{spec: self.computer.chunk_key(seg, spec).storage_key for spec in order} for seg in segments]
        known = self.catalog.entry_sizes([k for per in keyed for k in per.values()])
        chunks = [
            ChunkOptions(len(seg), {spec: known[k] for spec, k in per.items() if k in known})
            for seg, per in zip(segments, keyed, strict=True)
        ]
        return LoadSession(
            chunks,
            order,
            plan.estimates,
            self.store.read_estimates,
            deadline=plan.deadline,
            reserve_s=plan.reserve_s,
            fusion_ratio=plan.fusion_ratio,
            slack=plan.config.ttft_slack,
            decode_workers=self.decode_workers,
        )

    def _finish_loads(
        self,
        segments: Sequence[Sequence[int]],
        keys: list[ChunkKey],
        unique: list[int],
        decoded: dict[int, ChunkKV | None],
        sizes: dict[int, int | None],
        text: set[int],
        local: set[int],
    ) -> dict[int, LoadedChunk]:
        """Hits as loaded; text chunks as placeholders; local ones as prefilled; misses computed and
        stored; hits touched."""
        done: dict[int, LoadedChunk] = {}
        for i in unique:
            if i in text:
                done[i] = LoadedChunk(self.adapter.empty_kv(len(segments[i])), False, 0, recompute=True)
                continue
            kv = decoded[i]
            if i in local and kv is not None:
                done[i] = LoadedChunk(kv, False, 0, local=True)
                continue
            size = sizes[i]
            if kv is not None and size is not None:
                done[i] = LoadedChunk(kv, True, size)
                continue
            if size is not None:  # present but unusable: drop it everywhere, then recompute
                self.store.invalidate(keys[i].storage_key)
                if self.device_tier is not None:
                    self.device_tier.discard(keys[i].storage_key)
                if self.host_tier is not None:
                    self.host_tier.discard(keys[i].storage_key)
            kv = self.adapter.prefill_kv(segments[i], past=[self.computer.prefix_kv()])
            done[i] = LoadedChunk(kv, False, self._put(kv, keys[i]))
        hits = [keys[i].storage_key for i in unique if done[i].hit]
        if hits:
            self.catalog.touch_entries(hits)
        return done

    def _timed_decode(self, key: ChunkKey, num_tokens: int, blob: bytes) -> tuple[ChunkKV | None, float, float]:
        """:meth:`_decode`, and when it started and ended (``time.perf_counter()``; on a decode thread
        when there are several)."""
        started = time.perf_counter()
        kv = self._decode(key, num_tokens, blob)
        return kv, started, time.perf_counter()

    def _decode(self, key: ChunkKey, num_tokens: int, blob: bytes) -> ChunkKV | None:
        """The stored cache in ``blob``, or None (with a warning) if it is not what ``key`` asks for.

        None for a damaged, truncated or unauthenticated blob, and for an intact one made for
        another key (a swapped or moved entry), model, codec, level or shape; the caller then
        invalidates the entry and recomputes the chunk.
        """
        # Everything expected comes from the key asked for and the loaded model, never from the
        # stored bytes: a blob made for another chunk, tenant, codec or shape is refused before
        # its payload is read.
        expect = expected_blob(key, self.adapter.spec, num_tokens, self.store_secret)
        try:
            # the key digests the transform, so the one it names is the one this process holds
            transform = self.computer.transforms.find(key.transform_digest) if key.transform_digest else None
            on_host = self._stays_on_host(key)
            device = "cpu" if on_host else str(self.adapter.device)
            dtype = self.adapter.dtype
            return codec.decode(blob, expect=expect, device=device, dtype=dtype, transform=transform, view=on_host)
        except CodecError as e:
            logger.warning("unusable cache entry %s (%s); recomputing", key.storage_key, e)
            return None

    def _stays_on_host(self, key: ChunkKey) -> bool:
        """Whether ``key``'s chunk is decoded into host memory for a model on a GPU: raw bytes need no
        decode, so they stay on the host and fusion stages them layer by layer through pinned memory
        while earlier layers compute (ragkv.gpu.feed)."""
        return self.adapter.device.type == "cuda" and key.codec.name == "raw"

    def _decoded_dtype(self, key: ChunkKey) -> torch.dtype:
        """The dtype :meth:`_decode` gives ``key``'s chunk: a raw chunk kept on the host stays the fp16
        it is stored in (``codec.decode(view=True)``) unless it was coded in a channel transform."""
        return torch.float16 if self._stays_on_host(key) and not key.transform_digest else self.adapter.dtype

    def _put(self, kv: ChunkKV, key: ChunkKey) -> int:
        """Encode and store a recomputed cache; record it in the catalog; bytes stored (0: not stored).

        Never for a chunk of a removed document (a request queued before a DELETE loads after it):
        checked before storing, and again, atomically with the removal's mark, when recording; a
        cache stored in between is erased."""
        tenant = self.computer.tenant
        if self.catalog.is_removed(tenant, key.tokens_digest):
            return 0
        entry = self.computer.put(kv, key)
        if entry is None:
            return 0
        if not record_stored(self.catalog, entry, tenant=tenant, unless_removed=True):
            self.store.erase(entry.storage_key)
            return 0
        return entry.nbytes
