"""Ray Serve request routers for ragkv's replicas: chunk affinity, and round-robin as a baseline.

They run wherever a handle to the engine deployment lives (the ingress). ``ChunkAffinityRouter``
reads the request's chunks from the ``route`` keyword the ingress passes (``ChunkRef``s) and each
replica's holdings from its routing stats (``record_routing_stats``, refreshed every
``request_routing_stats_period_s``) and from the chunks it sent there itself lately
(:class:`~ragkv.replicas.affinity.RecentRoutes`), and ranks replicas with :func:`ragkv.replicas.affinity.rank_replicas`.
Serve then sends the request to the first ranked replica that accepts it (a full one is skipped).

No ``FIFOMixin`` here: with it, the replica chosen for one request may be handed to the oldest
waiting request instead, which would throw the chunk match away under load.

Ray Serve is an optional extra (``pip install 'ragkv[ray]'``); import this module only with it.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ragkv.replicas.affinity import (
    AffinityConfig,
    ChunkRef,
    Holdings,
    RecentRoutes,
    ReplicaView,
    power_of_two,
    rank_replicas,
)

logger = logging.getLogger(__name__)

__all__ = ["HOLDINGS_STAT", "ChunkAffinityRouter", "RoundRobinRouter"]

HOLDINGS_STAT = "ragkv_holdings"  # the routing-stats field a replica reports its holdings summary in


class ChunkAffinityRouter(RequestRouter):
    """Routes a request to the replica whose memory and device tiers hold most of its chunk tokens,
    less a load term; power of two choices when none holds any, or on any error of its own."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Serve passes ``RequestRouterConfig.request_router_kwargs`` here (``AffinityConfig`` fields, ``seed``)."""
        seed = kwargs.pop("seed", None)
        self._config = AffinityConfig(**kwargs)
        self._rng = random.Random(seed)
        self._in_flight: Counter[str] = Counter()  # requests this router sent and not yet completed, per replica
        self._tokens: Counter[str] = Counter()  # ... and their chunk tokens
        self._routed: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, chunk tokens)
        self.decisions: Counter[str] = Counter()  # "affinity" / "power_of_two" / "error": how requests were routed
        self._recent = RecentRoutes(self._config.recent_s)  # chunks sent lately, held before summaries show them
        self._window: deque[str] = deque(maxlen=self._config.window)  # the last routes' replicas (window bound)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Replicas ranked best first, one per rank (Serve tries the next rank when one is full)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        live = set(by_id) | {r.unique_id for r in self.curr_replicas}  # candidates can be a subset (a retry)
        for gone in set(self._recent.replicas()) - live:
            self._recent.forget(gone)
        try:
            chunks = _route_of(pending_request)
            window = Counter(self._window)
            views = {rid: self._view(r, bool(chunks), window[rid]) for rid, r in by_id.items()}
            ranking = rank_replicas(chunks, views, self._config, self._rng)
        except Exception:  # a bad summary or hint must not stop routing: fall back to power of two
            logger.warning("chunk-affinity routing failed; using power of two choices", exc_info=True)
            self.decisions["error"] += 1
            return [[by_id[i] for i in power_of_two(list(by_id), self._rng)]] if by_id else []
        self.decisions[ranking.how] += 1
        if ranking.how == "power_of_two":  # Serve picks the less loaded of the pair
            return [[by_id[i] for i in ranking.order]]
        return [[by_id[i]] for i in ranking.order]

    def _view(self, replica: RunningReplica, with_holdings: bool, recent: int = 0) -> ReplicaView:
        rid = replica.replica_id.unique_id
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        queue = max(self._in_flight[rid], cached or 0)
        holdings = Holdings()
        if with_holdings:
            reported = Holdings.from_stats(replica.routing_stats.get(HOLDINGS_STAT))
            holdings = Holdings(reported.tags | self._recent.tags(rid))
        return ReplicaView(holdings, queue, max(self._tokens[rid], 0), recent)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count the request and its chunk tokens as in flight on ``replica_id`` until it completes."""
        rid = replica_id.unique_id
        self._in_flight[rid] += 1
        if self._config.window:
            self._window.append(rid)
        try:
            chunks = _route_of(pending_request)
            tokens = sum(max(c.tokens, 0) for c in chunks)
            request_id = pending_request.metadata.internal_request_id
        except Exception:  # no route, or one the router could not read: nothing to weigh
            return
        self._recent.add(rid, chunks)
        if tokens and request_id:
            self._tokens[rid] += tokens
            self._routed[request_id] = (rid, tokens)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request left the replica: one less in flight there, and its chunk tokens."""
        rid = replica_id.unique_id
        if self._in_flight[rid] > 0:
            self._in_flight[rid] -= 1
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self._tokens[routed[0]] -= routed[1]


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (a baseline for ``ragkv bench replicas``)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """No settings."""
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The next replica by id order, then the others in turn (when it is full)."""
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[start:] + ordered[:start]]


def _route_of(pending_request: PendingRequest | None) -> list[ChunkRef]:
    """The request's chunks from the ``route`` keyword the ingress sends (none: an empty list)."""
    if pending_request is None:
        return []
    route = pending_request.kwargs.get("route")
    if not route:
        return []
    return [c if isinstance(c, ChunkRef) else ChunkRef(tuple(c[0]), int(c[1])) for c in route]
