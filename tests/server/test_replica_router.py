"""ChunkAffinityRouter and RoundRobinRouter as Serve calls them, on stand-in replicas (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from ragkv.replicas.affinity import ChunkRef, Holdings, key_tag  # noqa: E402
from ragkv.replicas.router import HOLDINGS_STAT, ChunkAffinityRouter, RoundRobinRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="ragkv-engine", app_name="ragkv")
CHUNK = ChunkRef((key_tag("ns:apples:int8"),), 200)


def replica(name: str, stats: Any = None) -> Any:
    """What the router reads of a RunningReplica: its id and routing stats."""
    return SimpleNamespace(
        replica_id=ReplicaID(name, DEPLOYMENT), routing_stats={HOLDINGS_STAT: stats} if stats else {}
    )


NO_REQUEST = object()


def choose(router: Any, replicas: list[Any], route: Any = NO_REQUEST) -> list[list[str]]:
    """One routing iteration for a request carrying ``route`` (or for no request), as replica ids."""

    async def run() -> list[list[str]]:  # a PendingRequest holds a Future: make it inside the loop
        pending = None
        if route is not NO_REQUEST:
            meta = RequestMetadata("r", "r", call_method="forward")
            pending = PendingRequest(args=[], kwargs={"route": route}, metadata=meta)
        ranks = await router.choose_replicas(replicas, pending)
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    return asyncio.run(run())


def make(cls: type) -> Any:
    async def build() -> Any:  # the router makes asyncio objects: build it inside a loop, as Serve does
        router = cls(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(seed=0) if cls is ChunkAffinityRouter else router.initialize_state()
        return router

    return asyncio.run(build())


def test_the_holder_ranks_first_one_replica_per_rank():
    router = make(ChunkAffinityRouter)
    holder = replica("b", Holdings.of(["ns:apples:int8"], 10).as_stats())
    ranks = choose(router, [replica("a"), holder, replica("c")], [CHUNK])
    assert ranks[0] == ["b"] and sorted(sum(ranks, [])) == ["a", "b", "c"]
    assert router.decisions["affinity"] == 1


def test_no_route_bad_stats_or_a_bad_route_fall_back_to_power_of_two():
    router = make(ChunkAffinityRouter)
    replicas = [replica("a", ["junk"]), replica("b", 42), replica("c")]
    for route in (NO_REQUEST, None, [CHUNK]):  # no request, no route, nothing held anywhere
        ranks = choose(router, replicas, route)
        assert len(ranks) == 1 and len(ranks[0]) == 2  # one pair: Serve takes its less loaded
    ranks = choose(router, replicas, [("not", "a", "chunk")])  # a broken hint: an error, then the pair
    assert len(ranks) == 1 and len(ranks[0]) == 2 and router.decisions["error"] == 1


def test_round_robin_turns():
    router = make(RoundRobinRouter)
    replicas = [replica("b"), replica("a"), replica("c")]
    firsts = [choose(router, replicas)[0][0] for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]


def test_the_router_counts_in_flight_chunk_tokens_until_each_request_completes():
    router = make(ChunkAffinityRouter)
    long = ChunkRef((key_tag("ns:long:int8"),), 5000)

    async def route(request_id: str, rid: str, chunks: list[ChunkRef]) -> None:
        meta = RequestMetadata(request_id, request_id, call_method="forward")
        pending = PendingRequest(args=[], kwargs={"route": chunks}, metadata=meta)
        router.on_request_routed(pending, ReplicaID(rid, DEPLOYMENT), None)

    asyncio.run(route("q1", "a", [long, CHUNK]))
    asyncio.run(route("q2", "a", [CHUNK]))
    assert router._view(replica("a"), False).tokens == 5400
    router.on_request_completed(ReplicaID("a", DEPLOYMENT), "q1")
    assert router._view(replica("a"), False).tokens == 200
    router.on_request_completed(ReplicaID("a", DEPLOYMENT), "q1")  # a second completion changes nothing
    router.on_request_completed(ReplicaID("a", DEPLOYMENT), "q2")
    assert router._view(replica("a"), False).tokens == 0 and router._routed == {}


def test_a_chunk_just_routed_counts_as_held_there_before_any_summary_shows_it():
    router = make(ChunkAffinityRouter)
    replicas = [replica("a"), replica("b"), replica("c")]

    async def route_once() -> list[list[str]]:
        meta = RequestMetadata("r1", "r1", call_method="forward")
        pending = PendingRequest(args=[], kwargs={"route": [CHUNK]}, metadata=meta)
        ranks = await router.choose_replicas(replicas, pending)
        router.on_request_routed(pending, ranks[0][0].replica_id, None)  # Serve sends it to the first
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    first = asyncio.run(route_once())  # nothing held anywhere: a power-of-two pair
    assert len(first) == 1 and len(first[0]) == 2
    sent_to = first[0][0]
    again = choose(router, replicas, [CHUNK])  # no summary shows it yet: the router's own record does
    assert again[0] == [sent_to] and router.decisions["affinity"] == 1
    gone = [r for r in replicas if r.replica_id.unique_id != sent_to]
    assert len(choose(router, gone, [CHUNK])[0]) == 2  # that replica left: its record goes with it


def test_the_window_bound_sends_a_request_past_the_holders_share_elsewhere():
    async def build() -> Any:
        router = ChunkAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(seed=0, window=6, window_balance=1.5, balance=0)
        return router

    router = asyncio.run(build())
    holder = replica("b", Holdings.of(["ns:apples:int8"], 10).as_stats())
    replicas = [replica("a"), holder, replica("c")]

    async def route_once(n: int) -> str:
        meta = RequestMetadata(f"r{n}", f"r{n}", call_method="forward")
        pending = PendingRequest(args=[], kwargs={"route": [CHUNK]}, metadata=meta)
        ranks = await router.choose_replicas(replicas, pending)
        router.on_request_routed(pending, ranks[0][0].replica_id, None)
        router.on_request_completed(ranks[0][0].replica_id, f"r{n}")  # done at once: nothing stays in flight
        return str(ranks[0][0].replica_id.unique_id)

    firsts = [asyncio.run(route_once(n)) for n in range(12)]
    # of any 7 routes in a row the holder takes at most ceil(1.5 * 7 / 3) = 4: the first 4, then others
    assert all(firsts[i : i + 7].count("b") <= 4 for i in range(len(firsts) - 6)), firsts
    assert firsts[:4] == ["b"] * 4 and firsts[4] != "b"
