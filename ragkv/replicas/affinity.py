"""Chunk-affinity scoring: which replica's fast tiers hold a request's chunks, weighed against its load.

Pure functions and small records, no Ray: the router (``ragkv.replicas.router``) feeds them what
Serve knows (each replica's holdings summary and queue length) and ranks replicas with them.

The score is the production-stack router's (matched share minus a load term) with chunk tokens in
place of prefix tokens, since a RAG prompt's chunks sit in its middle, where a prefix hash cannot see
them::

    score(r) = held_tokens(r) / request_tokens - load_weight * load(r)
    load(r)  = max(min(queue(r), load_cap) / load_cap, min(in_flight_tokens(r), token_cap) / token_cap)

``queue`` counts requests queued and running at the replica; ``in_flight_tokens`` the chunk tokens
of the requests this router sent there and that have not completed (a few long prompts load a
replica as much as many short ones).

The score alone lets a replica that holds the popular chunks take nearly every request (a full
match outweighs any load term below the cap) while another, holding nothing, is never chosen and
never comes to hold anything. So the ranking also bounds each replica's load, as consistent
hashing with bounded loads does (Mirrokni, Thorup and Zadimoghaddam, 2018): with ``T`` requests in
flight over ``n`` replicas, a replica may take the new one only while its queue stays within
``ceil(balance * (T + 1) / n)``; replicas past that bound rank after every other, by score.
At a low request rate few requests are in flight, so that bound is loose (with two in flight over
three replicas one replica may hold both); a bound of the same form over the router's last
``window`` routes (``window_balance``) keeps a replica's share of the traffic near the mean.

Nothing here decides what an answer is: a replica that no longer holds a chunk its summary claims
loads it from the shared store (a miss), so a stale or wrong summary costs time, never correctness.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NewType

__all__ = [
    "AffinityConfig",
    "ChunkRef",
    "Holdings",
    "KeyTag",
    "Ranking",
    "RecentRoutes",
    "ReplicaView",
    "key_tag",
    "load_bound",
    "power_of_two",
    "rank_replicas",
    "score",
    "window_bound",
]

KeyTag = NewType("KeyTag", str)  # 16 hex chars of sha256(storage key): what a holdings summary lists

TAG_CHARS = 16  # 64 bits: a false match among a few thousand held keys is ~1e-13, and costs only a miss


def key_tag(storage_key: str) -> KeyTag:
    """The tag a holdings summary stores for ``storage_key`` (a storage key's first 16 characters
    are its tenant namespace, shared by all of a tenant's keys, so the key is hashed, not cut).

    >>> key_tag("0123456789abcdef:deadbeef")
    '93408044cbe642aa'
    """
    return KeyTag(hashlib.sha256(storage_key.encode()).hexdigest()[:TAG_CHARS])


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of a request, as the router sees it."""

    tags: tuple[KeyTag, ...]  # its storage keys' tags, one per codec it is stored at; any held counts
    tokens: int  # its token count: the prefill a replica holding it saves


@dataclass(frozen=True, slots=True)
class Holdings:
    """A replica's summary of the chunk caches its fast tiers (memory, device) hold: a bounded tag set.

    Made by the replica every routing-stats period (not per request) and read by the router as is.
    """

    tags: frozenset[KeyTag] = frozenset()

    @classmethod
    def of(cls, storage_keys: Iterable[str], limit: int) -> Holdings:
        """The summary of ``storage_keys``, at most ``limit`` of them (the first ``limit`` given)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1 (keys a summary lists), got {limit}")
        tags: set[KeyTag] = set()
        for key in storage_keys:
            if len(tags) >= limit:
                break
            tags.add(key_tag(key))
        return cls(frozenset(tags))

    def held_tokens(self, chunks: Sequence[ChunkRef]) -> int:
        """Tokens of ``chunks`` this replica holds."""
        return sum(c.tokens for c in chunks if any(t in self.tags for t in c.tags))

    def as_stats(self) -> list[str]:
        """The summary as Serve's routing stats carry it (a sorted list of tags)."""
        return sorted(self.tags)

    @classmethod
    def from_stats(cls, value: object) -> Holdings:
        """The summary from routing stats; anything malformed is an empty summary (a miss, not an error)."""
        if not isinstance(value, list | tuple | set | frozenset):
            return cls()
        return cls(frozenset(KeyTag(v) for v in value if isinstance(v, str) and len(v) == TAG_CHARS))


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """How the chunk-affinity router weighs holdings against load."""

    load_weight: float = 0.5  # the score a replica loses at a full load term (queue >= load_cap)
    load_cap: int = 8  # queue length at which the load term stops growing
    token_cap: int = 16384  # in-flight chunk tokens at which the load term stops growing
    min_share: float = 0.0  # a best matched share at or below this: nothing held, power of two decides
    # Seconds a chunk the router sent to a replica counts as held there (RecentRoutes): a replica's
    # summary shows a chunk only once its request has run and the next stats period (2 s by default)
    # has passed. Without it the requests for the same chunks in that window scatter. 0 = off.
    recent_s: float = 10.0
    # Bounded loads (the module docstring): a replica whose queue would pass balance * the mean
    # (rounded up) ranks after all others. 0 = off (score only). 2: on the bench's workload 1.25
    # cost hits (0.74 against 0.83) for no gain in p95, 2 kept them (docs/benchmarks.md, "Replicas").
    balance: float = 2.0
    # A bound over the router's last ``window`` routes (0 = off): a replica that would take more than
    # ceil(window_balance * (window + 1) / n) of them, the new one included, ranks after every replica
    # within both bounds (window_bound). It bounds each replica's share of the traffic, which the
    # in-flight bound does not at a low rate. 24 and 1.4: at most 12 of any 25 routes over 3
    # replicas (1.44x the mean); on the bench's seed 0 1.25 and 1.5 cost no more than 0.02 of hit
    # rate (docs/benchmarks.md, "Replicas").
    window: int = 24
    window_balance: float = 1.4

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        if self.load_cap < 1:
            raise ValueError(f"load_cap must be >= 1 (requests), got {self.load_cap}")
        if self.token_cap < 1:
            raise ValueError(f"token_cap must be >= 1 (tokens), got {self.token_cap}")
        if not 0 <= self.min_share < 1:
            raise ValueError(f"min_share must be in [0, 1), got {self.min_share}")
        if self.recent_s < 0:
            raise ValueError(f"recent_s must be >= 0 (seconds; 0 = off), got {self.recent_s}")
        if self.balance != 0 and self.balance < 1:
            raise ValueError(f"balance must be >= 1 (a replica's queue bound, in means) or 0 (off), got {self.balance}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (recent routes; 0 = off), got {self.window}")
        if self.window_balance < 1:
            raise ValueError(
                f"window_balance must be >= 1 (a replica's share bound, in means), got {self.window_balance}"
            )


class RecentRoutes:
    """The chunks the router sent to each replica in the last ``ttl_s`` seconds, counted as held there.

    A replica's holdings summary lags: a chunk enters its memory tier when the request that needs it
    runs, and the summary is remade every routing-stats period. Requests for the same chunks routed
    in between would see no holder and scatter (power of two), each paying a load from the store.
    The router's own record of where it sent them closes that window; a route that never landed (a
    failed request, a replica gone) costs a miss, never a wrong answer. At most ``limit`` tags per
    replica, oldest dropped first.

    >>> now = [0.0]
    >>> recent = RecentRoutes(10.0, clock=lambda: now[0])
    >>> recent.add("r1", [ChunkRef((KeyTag("a" * 16),), 100)])
    >>> sorted(recent.tags("r1")), sorted(recent.tags("r2"))
    (['aaaaaaaaaaaaaaaa'], [])
    >>> now[0] = 10.5
    >>> sorted(recent.tags("r1"))
    []
    """

    def __init__(self, ttl_s: float, limit: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0 or limit < 1:
            raise ValueError(f"ttl_s must be >= 0 and limit >= 1, got {ttl_s} and {limit}")
        self.ttl_s, self.limit, self._clock = ttl_s, limit, clock
        self._routed: dict[str, OrderedDict[KeyTag, float]] = {}  # replica -> tag -> when routed, oldest first

    def add(self, replica: str, chunks: Sequence[ChunkRef]) -> None:
        """``chunks`` were just sent to ``replica``."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        routed = self._routed.setdefault(replica, OrderedDict())
        for chunk in chunks:
            for tag in chunk.tags:
                routed.pop(tag, None)  # re-added: it becomes the newest
                routed[tag] = now
        while len(routed) > self.limit:
            routed.popitem(last=False)

    def tags(self, replica: str) -> frozenset[KeyTag]:
        """The tags sent to ``replica`` within the last ``ttl_s`` seconds (older ones are dropped)."""
        routed = self._routed.get(replica)
        if not routed:
            return frozenset()
        cutoff = self._clock() - self.ttl_s
        while routed and next(iter(routed.values())) <= cutoff:
            routed.popitem(last=False)
        return frozenset(routed)

    def replicas(self) -> list[str]:
        """The replicas anything was sent to (and not forgotten)."""
        return list(self._routed)

    def forget(self, replica: str) -> None:
        """Drop everything sent to ``replica`` (it is gone)."""
        self._routed.pop(replica, None)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica when it routes."""

    holdings: Holdings = field(default_factory=Holdings)
    queue: int = 0  # requests queued and running there (Serve's queue length, or the router's own count)
    tokens: int = 0  # chunk tokens of the requests routed there and not completed
    recent: int = 0  # of the router's last ``AffinityConfig.window`` routes, those sent here


@dataclass(frozen=True, slots=True)
class Ranking:
    """Replica ids, best first, and how they were chosen."""

    order: tuple[str, ...]
    how: Literal["affinity", "power_of_two"]


def score(held_tokens: int, request_tokens: int, queue: int, config: AffinityConfig, tokens: int = 0) -> float:
    """Matched share minus the load term (see the module docstring).

    >>> score(300, 400, 0, AffinityConfig())
    0.75
    >>> score(300, 400, 100, AffinityConfig(load_weight=0.5, load_cap=8))  # load capped at 8
    0.25
    >>> score(300, 400, 1, AffinityConfig(load_cap=8, token_cap=1000), tokens=500)  # tokens weigh more here
    0.5
    """
    share = held_tokens / request_tokens if request_tokens > 0 else 0.0
    by_queue = min(max(queue, 0), config.load_cap) / config.load_cap
    by_tokens = min(max(tokens, 0), config.token_cap) / config.token_cap
    return share - config.load_weight * max(by_queue, by_tokens)


def power_of_two(ids: Sequence[str], rng: random.Random) -> tuple[str, ...]:
    """Two distinct replica ids drawn at random (one when there is one): Serve's default router
    then sends the request to the less loaded of them."""
    if len(ids) <= 2:
        return tuple(rng.sample(list(ids), len(ids)))
    return tuple(rng.sample(list(ids), 2))


def rank_replicas(
    chunks: Sequence[ChunkRef],
    replicas: Mapping[str, ReplicaView],
    config: AffinityConfig,
    rng: random.Random,
) -> Ranking:
    """Every replica ranked by :func:`score`, or a power-of-two pair when none holds any chunk.

    Ties go to the shorter queue, then to a random draw (so equal replicas share the work). With
    ``config.balance``, replicas whose queue is past the bounded-load bound (:func:`load_bound`)
    rank after all others; with ``config.window``, so do those past the same bound over their
    recent routes (``ReplicaView.recent``, bound factor ``config.window_balance``).
    """
    ids = list(replicas)
    total = sum(max(c.tokens, 0) for c in chunks)
    if not ids:
        return Ranking((), "power_of_two")
    held = {r: replicas[r].holdings.held_tokens(chunks) for r in ids}
    if total <= 0 or max(held.values()) / total <= config.min_share:
        return Ranking(power_of_two(ids, rng), "power_of_two")
    draw = {r: rng.random() for r in ids}

    def key(r: str) -> tuple[float, int, float]:
        view = replicas[r]
        return -score(held[r], total, view.queue, config, view.tokens), view.queue, draw[r]

    order = sorted(ids, key=key)
    within = set(ids)
    if config.balance:
        bound = load_bound([replicas[r].queue for r in ids], config.balance)
        within = {r for r in within if replicas[r].queue + 1 <= bound}
    if config.window:
        bound = window_bound(config.window, len(ids), config.window_balance)
        within = {r for r in within if replicas[r].recent + 1 <= bound}
    order = [r for r in order if r in within] + [r for r in order if r not in within]
    return Ranking(tuple(order), "affinity")


def window_bound(window: int, replicas: int, balance: float) -> int:
    """The most of any ``window + 1`` consecutive routes one replica may take: ``ceil(balance * (window + 1) / n)``.

    Fixed by the window's length, not by the routes seen so far, so a fresh router is not held to
    round-robin over its first requests.

    >>> window_bound(24, 3, 1.4), window_bound(24, 3, 1.5), window_bound(12, 3, 1.5)
    (12, 13, 7)
    """
    return math.ceil(balance * (window + 1) / max(1, replicas))


def load_bound(queues: Sequence[int], balance: float) -> int:
    """The most requests a replica may hold, the new one included: ``ceil(balance * (T + 1) / n)``
    with ``T`` the requests in flight over the ``n`` replicas (bounded loads).

    >>> load_bound([0, 0, 0], 1.25), load_bound([1, 0, 0], 1.25), load_bound([2, 1, 0], 1.25)
    (1, 1, 2)
    """
    return math.ceil(balance * (sum(max(q, 0) for q in queues) + 1) / max(1, len(queues)))
