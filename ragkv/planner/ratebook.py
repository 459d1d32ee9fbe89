"""``RateBook``: the measured load speeds, kept in a small JSON file for the next process.

A process that starts cold knows nothing of its links: it would plan its first answers on first
guesses (a remote tier at 1 Gbit/s), or spend its first chunk on a probe. The book keeps, next to
the catalog (``<data_dir>/load_rates.json``), what the last process measured: each tier's read
latency and bytes/s keyed by the tier's display URL (no password, no query), each stored level's
decode speed, and the model's prefill speed, fusion cost and decode overlap (decodes running side
by side on the loader's threads) keyed by model and device. It is JSON,
read with ``json.loads`` and checked value by value: a damaged, foreign or partial file is
ignored (logged) and the process starts from first guesses, never fails. Writes replace the file
atomically (a temporary file, then ``os.replace``); several processes sharing a data dir each
write their own view, the last one wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ragkv.cache.store import TieredStore
from ragkv.planner.session import LoadEstimates

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "RateBook"]

FORMAT = "ragkv-load-rates/1"
_SAVE_EVERY_S = 5.0  # save_soon writes at most this often


def _positive(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def _non_negative(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else None


class RateBook:
    """Seeds a store's tier estimates and an engine's load estimates from ``path``, and saves them there.

    Args:
        path: the JSON file; None: keep nothing (every call is a no-op).
        store: whose tiers' read estimates are seeded and saved (by the tier's display URL).
        estimates: the engine's decode, prefill and fusion estimates.
        model: the model and device the prefill and fusion speeds belong to.
    """

    def __init__(self, path: Path | None, store: TieredStore, estimates: LoadEstimates, *, model: str) -> None:
        self.path, self.store, self.estimates, self.model = path, store, estimates, model
        self._lock = threading.Lock()
        self._saved_at = 0.0

    def load(self) -> int:
        """Seed the estimates from the file; returns how many values were taken (0: none, or no file)."""
        if self.path is None or not self.path.exists():
            return 0
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s (unreadable: %s); load speeds start from first guesses", self.path, exc)
            return 0
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            logger.warning("ignoring %s: not a %s file; load speeds start from first guesses", self.path, FORMAT)
            return 0
        taken = 0
        tiers, links = data.get("tiers"), self.store.read_estimates()
        for tier in self.store.tiers:
            got = tiers.get(tier.name) if isinstance(tiers, dict) else None
            if not isinstance(got, dict):
                continue
            rate, latency = _positive(got.get("rate_bps")), _non_negative(got.get("latency_s"))
            link = links.get(tier.name)
            if rate is not None and latency is not None and link is not None and link.samples == 0:
                link.seed(rate, latency)
                taken += 1
        decode = data.get("decode")
        for key, value in decode.items() if isinstance(decode, dict) else ():
            rate = _positive(value)
            if isinstance(key, str) and rate is not None and len(key) < 100:
                est = self.estimates.decode(key)
                if est.samples == 0:
                    est.seed(rate)
                    taken += 1
        models = data.get("models")
        mine = models.get(self.model) if isinstance(models, dict) else None
        if isinstance(mine, dict):
            tps, fixed = _positive(mine.get("recompute_tps")), _non_negative(mine.get("fusion_fixed_s"))
            if tps is not None and self.estimates.recompute.samples == 0:
                self.estimates.recompute.seed(tps)
                taken += 1
            if fixed is not None and self.estimates.fusion_fixed.samples == 0:
                self.estimates.fusion_fixed.seed(fixed)
                taken += 1
            overlap = _positive(mine.get("decode_overlap"))
            if overlap is not None and overlap >= 1 and self.estimates.decode_overlap.samples == 0:
                self.estimates.decode_overlap.seed(overlap)
                taken += 1
        logger.debug("seeded %d load speed(s) from %s", taken, self.path)
        return taken

    def save_soon(self) -> None:
        """:meth:`save`, unless the last save was under a few seconds ago."""
        if self.path is not None and time.monotonic() - self._saved_at >= _SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        """Write the measured speeds (merged into what the file holds for other tiers and models)."""
        if self.path is None:
            return
        with self._lock:
            self._saved_at = time.monotonic()
            data = self._current()
            tmp: str | None = None
            try:
                fd, tmp = tempfile.mkstemp(prefix=".load_rates-", suffix=".json", dir=self.path.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
                tmp = None
            except OSError as exc:  # a read-only or full data dir: the speeds are only lost, not wrong
                logger.warning("could not save load speeds to %s: %s", self.path, exc)
            finally:
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)

    def _current(self) -> dict[str, Any]:
        old: dict[str, Any] = {}
        try:
            assert self.path is not None
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
                old = loaded
        except (OSError, ValueError):
            pass
        tiers, decode, models = (_mapping(old.get(name)) for name in ("tiers", "decode", "models"))
        links = self.store.read_estimates()
        for tier in self.store.tiers:
            link = links.get(tier.name)
            if link is not None and link.samples > 0:
                tiers[tier.name] = {"rate_bps": link.rate, "latency_s": link.latency, "samples": link.samples}
        decode.update(self.estimates.decode_rates())
        mine = _mapping(models.get(self.model))
        if self.estimates.recompute.samples > 0:
            mine["recompute_tps"] = self.estimates.recompute.rate
            mine["fusion_fixed_s"] = self.estimates.fusion_fixed.value
        if self.estimates.decode_overlap.samples > 0:
            mine["decode_overlap"] = self.estimates.decode_overlap.rate
        if mine:
            models[self.model] = mine
        return {"format": FORMAT, "tiers": tiers, "decode": decode, "models": models}


def _mapping(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else empty (a damaged file's part is dropped on save)."""
    return {k: v for k, v in value.items() if isinstance(k, str)} if isinstance(value, dict) else {}
