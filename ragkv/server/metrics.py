"""Prometheus text metrics, hand-written (the format is a few lines; no client library needed)."""

from __future__ import annotations

import threading
from collections import defaultdict

from ragkv.types import GenerationStats

__all__ = ["Metrics"]

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts = buckets, [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters and histograms of one server process; :meth:`render` gives the Prometheus text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.ttft = _Histogram(_SECONDS)
        self.latency = _Histogram(_SECONDS)
        self.tokens = {"prompt": 0, "reused": 0, "recomputed": 0, "prefilled_chunk": 0, "generated": 0}
        self.finished: defaultdict[str, int] = defaultdict(int)  # finish reason -> count

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def observe_generation(self, stats: GenerationStats, how: str) -> None:
        with self._lock:
            self.ttft.observe(stats.ttft_ms / 1000)
            self.latency.observe(stats.total_ms / 1000)
            self.tokens["prompt"] += stats.prompt_tokens
            self.tokens["reused"] += stats.reused_tokens
            self.tokens["recomputed"] += stats.recomputed_tokens
            self.tokens["prefilled_chunk"] += stats.prefilled_chunk_tokens
            self.tokens["generated"] += stats.generated_tokens
            self.finished[how] += 1

    def render(self, queue: tuple[int, int], tiers: dict[str, tuple[int, int, int]], steps: int) -> str:
        """The exposition text; ``queue`` is (waiting, decoding), ``tiers`` name -> (hits, misses, errors)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            requests = [
                f'ragkv_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.requests.items())
            ]
            metric("ragkv_requests_total", "counter", "HTTP requests by endpoint and status.", requests)
            finished = [f'ragkv_generations_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            metric("ragkv_generations_total", "counter", "Finished generations by finish reason.", finished)
            metric("ragkv_ttft_seconds", "histogram", "Time to first token.", self.ttft.lines("ragkv_ttft_seconds"))
            latency = self.latency.lines("ragkv_latency_seconds")
            metric("ragkv_latency_seconds", "histogram", "Request in to last token out.", latency)
            tokens = [f'ragkv_tokens_total{{kind="{k}"}} {n}' for k, n in self.tokens.items()]
            metric("ragkv_tokens_total", "counter", "Prompt and answer tokens by kind.", tokens)
            chunk = self.tokens["reused"] + self.tokens["recomputed"] + self.tokens["prefilled_chunk"]
            ratio = self.tokens["reused"] / chunk if chunk else 0.0
        metric(
            "ragkv_reused_token_ratio",
            "gauge",
            "Reused share of chunk tokens so far.",
            [f"ragkv_reused_token_ratio {ratio:.6f}"],
        )
        depth = [
            f'ragkv_queue_depth{{state="waiting"}} {queue[0]}',
            f'ragkv_queue_depth{{state="decoding"}} {queue[1]}',
        ]
        metric("ragkv_queue_depth", "gauge", "Requests waiting and decoding.", depth)
        metric("ragkv_decode_steps_total", "counter", "Batched decode steps.", [f"ragkv_decode_steps_total {steps}"])
        for i, what in enumerate(("hits", "misses", "errors")):
            samples = [f'ragkv_tier_{what}_total{{tier="{name}"}} {v[i]}' for name, v in sorted(tiers.items())]
            metric(f"ragkv_tier_{what}_total", "counter", f"Storage tier {what} (this process).", samples)
        return "\n".join(out) + "\n"
