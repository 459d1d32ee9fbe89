"""Running read-speed estimates: the EWMA, and the store measuring each tier's real reads."""

from __future__ import annotations

import pytest

from ragkv.cache.store import TieredStore, open_store
from ragkv.cache.tier import Tier
from ragkv.errors import StoreUnavailableError
from ragkv.planner.throughput import RateEstimate

KEY = "0123456789abcdef/" + "b" * 64


def test_estimate_starts_at_its_first_value_and_follows_measurements():
    r = RateEstimate(first=100.0, weight=0.5)
    assert r.rate == 100.0 and r.samples == 0
    r.observe(0, 1.0)  # nothing measured: ignored
    r.observe(10, 0.0)
    assert r.rate == 100.0 and r.samples == 0
    for _ in range(30):
        r.observe(1000.0, 1.0)
    assert r.rate == pytest.approx(1000.0, rel=1e-6) and r.samples == 30
    assert r.seconds(500.0) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("kw", [{"first": 0.0}, {"first": 1.0, "weight": 0.0}, {"first": 1.0, "weight": 1.5}])
def test_bad_estimate_settings_are_refused(kw):
    with pytest.raises(ValueError):
        RateEstimate(**kw)


def test_fetch_names_the_tier_and_measures_its_reads():
    with open_store("memory://,memory://") as store:
        assert set(store.read_rates()) == {"memory://", "memory:// [1]"}
        store.put(KEY, b"x" * 4096)
        got = store.fetch(KEY)
        assert got.value == b"x" * 4096 and got.tier == "memory://" and got.seconds > 0 and not got.failed
        missing = store.fetch("0123456789abcdef/" + "c" * 64)
        assert missing.value is None and missing.tier is None and not missing.failed


class _Broken(Tier):
    """A tier whose reads fail (a fault injected at the tier boundary)."""

    in_process = True

    def _get(self, key):
        raise StoreUnavailableError("down")

    def _put(self, key, value, cost=None):
        raise StoreUnavailableError("down")

    def _delete(self, key):
        raise StoreUnavailableError("down")

    def _contains(self, key):
        raise StoreUnavailableError("down")

    def _keys(self, namespace):
        raise StoreUnavailableError("down")


def test_fetch_reports_a_failing_tier():
    from ragkv.cache.config import TierConfig

    tier = _Broken(TierConfig.from_url("memory://"))
    with TieredStore([tier]) as store:
        got = store.fetch(KEY)
        assert got.value is None and got.failed
