"""What the ingress keeps for the whole cluster: quotas, upload turns and the replicas' metrics.

One ingress sees every request, so it is where per-tenant limits hold across replicas:

- :class:`ClusterGate` counts each tenant's requests per minute and concurrent generations (the
  ``ragkv serve`` quotas, :class:`ragkv.server.quotas.Quotas`, counted once for the cluster instead
  of once per replica), refuses generations past what the replicas hold together (429), and gives
  each tenant one document change at a time (an upload or a removal), so each replica's
  ``document_bytes``/``cache_bytes`` check reads the usage the change before it left in the shared
  catalog and store.
- :class:`MetricsBoard` holds the Prometheus text each replica last reported (every stats period)
  and renders them as one exposition, every sample labelled with its ``replica``: Prometheus then
  sums over replicas (``sum without (replica) (...)``), as it does for any scaled-out service. It
  keeps each replica's ``/health`` body too, and answers the cluster's: every replica's, with the
  queues and decode counters summed.

Pure Python, no Ray: :mod:`ragkv.replicas.app` wires them into the Serve ingress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.server.quotas import QuotaError, Quotas
from ragkv.server.settings import ServerSettings

__all__ = ["Admission", "ClusterGate", "MetricsBoard", "bearer_tenant", "sum_decode_counters"]

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
DOCUMENT_PATH = "/v1/documents"


def bearer_tenant(api_keys: dict[str, str], authorization: str) -> str | None:
    """The tenant of ``Authorization: Bearer KEY`` in ``api_keys`` (None: no key, or an unknown one).

    >>> bearer_tenant({"sk-1": "alpha"}, "Bearer sk-1"), bearer_tenant({"sk-1": "alpha"}, "Bearer sk-2")
    ('alpha', None)
    """
    scheme, _, key = authorization.partition(" ")
    return api_keys.get(key.strip()) if scheme.lower() == "bearer" else None


@dataclass(slots=True)
class Admission:
    """A request the gate let through; :meth:`ClusterGate.release` it when its response has ended."""

    tenant: str | None  # None: not counted (no /v1 route, or a key the replica will refuse with 401)
    generation: bool = False  # holds one of the tenant's concurrent-generation slots
    released: bool = False


class ClusterGate:
    """The cluster's per-tenant quotas and document turns, kept by the one ingress (see the module docstring)."""

    def __init__(self, settings: ServerSettings, base_tenant: str, capacity: int | None = None) -> None:
        """``capacity``: generations the replicas hold at once, all together (each its ``max_batch``
        decoding plus ``max_queue`` waiting); past it a generation is refused 429, as one full
        ``ragkv serve`` refuses it, instead of waiting unbounded in front of the replicas."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 generations (or None: no limit), got {capacity}")
        self.quotas = Quotas(settings.quota, settings.tenant_quotas)
        self.capacity = capacity
        self.generations = 0  # generations admitted and not yet released, all tenants
        self._keys = dict(settings.api_keys)
        self._base_tenant = base_tenant
        self._turns: dict[str, asyncio.Lock] = {}

    def tenant(self, method: str, path: str, authorization: str) -> str | None:
        """The tenant a request acts for, as ``ragkv serve`` decides it; None for requests no quota counts
        (outside /v1, CORS preflights, or a missing or unknown key: the replica answers those 401)."""
        if not path.startswith("/v1/") or method == "OPTIONS":
            return None
        if not self._keys:
            return self._base_tenant
        return bearer_tenant(self._keys, authorization)

    def admit(self, method: str, path: str, authorization: str) -> Admission:
        """Count the request against its tenant's quotas; raises QuotaError (429) past one of them."""
        tenant = self.tenant(method, path, authorization)
        if tenant is None:
            return Admission(None)
        self.quotas.count_request(tenant)
        generation = method == "POST" and path in GENERATION_PATHS
        if generation:
            if self.capacity is not None and self.generations >= self.capacity:
                raise QuotaError(429, f"the replicas hold {self.capacity} generations already; retry shortly", 1)
            self.quotas.start_generation(tenant)
            self.generations += 1
        return Admission(tenant, generation)

    def release(self, admission: Admission) -> None:
        """The request's response ended (sent whole, failed or cut off): free its generation slot."""
        if admission.generation and not admission.released and admission.tenant is not None:
            self.quotas.end_generation(admission.tenant)
            self.generations = max(0, self.generations - 1)
        admission.released = True

    def document_turn(self, method: str, path: str, tenant: str | None) -> asyncio.Lock | None:
        """The lock a document change (upload or removal) of ``tenant`` holds while it runs; None for
        any other request. One change per tenant at a time across replicas, as in one process."""
        if tenant is None or method not in ("POST", "DELETE") or not path.startswith(DOCUMENT_PATH):
            return None
        return self._turns.setdefault(tenant, asyncio.Lock())


class MetricsBoard:
    """Each replica's last Prometheus text; one exposition for the cluster (see the module docstring).

    A replica that has not reported for ``max_age_s`` (it died, or was replaced) drops out.
    """

    def __init__(self, max_age_s: float) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {max_age_s}")
        self.max_age_s = max_age_s
        self._reports: dict[str, tuple[float, str]] = {}
        self._health: dict[str, dict[str, Any]] = {}  # replica -> its last /health body (if it sent one)

    def report(
        self, replica: str, text: str, health: Mapping[str, Any] | None = None, now: float | None = None
    ) -> None:
        """Keep ``replica``'s exposition text (its whole ``/metrics`` body), and its ``/health`` body
        when given, as of ``now``."""
        self._reports[replica] = (time.monotonic() if now is None else now, text)
        if health is not None:
            self._health[replica] = dict(health)

    def replicas(self, now: float | None = None) -> list[str]:
        """The replicas whose last report is fresh, sorted; older ones are forgotten."""
        now = time.monotonic() if now is None else now
        for rid in [r for r, (at, _) in self._reports.items() if now - at > self.max_age_s]:
            del self._reports[rid]
            self._health.pop(rid, None)
        return sorted(self._reports)

    def health(self, now: float | None = None) -> dict[str, Any] | None:
        """The cluster's ``/health`` from the fresh replicas' last reports (None: none reported one).

        ``status`` is "ok" while any replica is (the ingress routes around the others); ``waiting``,
        ``decoding`` and the ``decode`` counters are summed over replicas; ``replicas`` holds each
        one's own body. Each is as of that replica's last report (at most a stats period old).
        """
        bodies = {rid: self._health[rid] for rid in self.replicas(now) if rid in self._health}
        if not bodies:
            return None
        ok = [b for b in bodies.values() if b.get("status") == "ok"]
        return {
            "status": "ok" if ok else "unavailable",
            "replicas_reporting": len(bodies),
            "replicas_ok": len(ok),
            "waiting": sum(int(b.get("waiting", 0)) for b in bodies.values()),
            "decoding": sum(int(b.get("decoding", 0)) for b in bodies.values()),
            "decode": sum_decode_counters([b["decode"] for b in bodies.values() if isinstance(b.get("decode"), dict)]),
            "replicas": bodies,
        }

    def render(self, now: float | None = None) -> str:
        """One exposition: every family once, its samples from each fresh replica with ``replica="ID"``,
        then ``ragkv_replicas_reporting`` (how many replicas it covers)."""
        live = self.replicas(now)
        families: dict[str, list[str]] = {}  # name -> HELP and TYPE lines, in first-seen order
        samples: dict[str, list[str]] = {}
        for rid in live:
            for family, header, sample in _parse(self._reports[rid][1]):
                families.setdefault(family, [])
                if header is not None and len(families[family]) < 2 and header not in families[family]:
                    families[family].append(header)
                if sample is not None:
                    samples.setdefault(family, []).append(_labelled(sample, rid))
        out: list[str] = []
        for family, headers in families.items():
            out.extend(headers)
            out.extend(samples.get(family, []))
        out += [
            "# HELP ragkv_replicas_reporting Engine replicas whose metrics this exposition covers.",
            "# TYPE ragkv_replicas_reporting gauge",
            f"ragkv_replicas_reporting {len(live)}",
        ]
        return "\n".join(out) + "\n"


_DECODE_TOTALS = (
    "steps",
    "carried_steps",
    "tokens",
    "prefill_pieces",
    "prefill_s",
    "decoding_pieces",
    "forward_s",
    "outside_s",
)


def sum_decode_counters(counters: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several schedulers' decode counters (``/health``'s ``decode``) as one: totals summed, the
    worst piece the largest, the per-step and per-token figures recomputed from the sums.

    >>> both = sum_decode_counters([{"tokens": 10, "outside_s": 0.1}, {"tokens": 30, "outside_s": 0.2}])
    >>> both["tokens"], both["outside_s"], both["outside_ms_per_token"]
    (40, 0.3, 7.5)
    """
    out: dict[str, float] = {k: round(sum(c.get(k, 0) for c in counters), 6) for k in _DECODE_TOTALS}
    pieces = out["decoding_pieces"]
    weighted = sum(c.get("decoding_piece_ms", 0.0) * c.get("decoding_pieces", 0) for c in counters)
    out["decoding_piece_ms"] = round(weighted / max(1, pieces), 3)
    out["max_decoding_piece_ms"] = max((c.get("max_decoding_piece_ms", 0.0) for c in counters), default=0.0)
    out["forward_ms_per_step"] = round(1000 * out["forward_s"] / max(1, out["steps"] - out["carried_steps"]), 3)
    out["outside_ms_per_token"] = round(1000 * out["outside_s"] / max(1, out["tokens"]), 3)
    return out


def _parse(text: str) -> Iterable[tuple[str, str | None, str | None]]:
    """``(family, header line or None, sample line or None)`` per line of an exposition."""
    family = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            family = line.split(" ", 3)[2]
            yield family, line, None
        elif not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            yield (family if name.startswith(family) and family else name), None, line


def _labelled(sample: str, replica: str) -> str:
    """``sample`` with ``replica="ID"`` as its first label.

    >>> _labelled('x_total{a="1"} 3', "r1"), _labelled("y 2", "r1")
    ('x_total{replica="r1",a="1"} 3', 'y{replica="r1"} 2')
    """
    label = 'replica="' + replica.replace("\\", "\\\\").replace('"', '\\"') + '"'
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    name, _, value = sample.partition(" ")
    return f"{name}{{{label}}} {value}"
