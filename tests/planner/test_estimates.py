"""The link estimate (latency + bytes/s), the cold-start probe, and measured speeds kept across processes."""

from __future__ import annotations

import json

import pytest

from ragkv.cache.link import LinkEstimate
from ragkv.cache.store import open_store
from ragkv.planner.config import LoadConfig
from ragkv.planner.plan import ChunkOptions
from ragkv.planner.ratebook import FORMAT, RateBook
from ragkv.planner.session import LoadEstimates, LoadSession
from ragkv.types import CodecSpec

ORDER = [CodecSpec("cachegen", level) for level in range(4)]


def test_reads_of_two_sizes_separate_latency_from_bandwidth():
    link = LinkEstimate(first=125e6, first_latency=0.0, weight=0.3)
    assert not link.measured and link.seconds(1e6) == pytest.approx(0.008)
    for _ in range(20):  # a 20 ms round trip, then 10 MB/s
        for nbytes in (250_000, 1_000_000, 2_000_000):
            link.observe(nbytes, 0.020 + nbytes / 10e6)
    assert link.measured and link.samples == 60
    assert link.latency == pytest.approx(0.020, rel=1e-3) and link.rate == pytest.approx(10e6, rel=1e-3)
    assert link.seconds(500_000) == pytest.approx(0.070, rel=1e-3)


def test_reads_of_one_size_keep_the_latency_and_show_a_drop_at_once():
    link = LinkEstimate(first=125e6, first_latency=0.001, weight=0.3)
    for _ in range(30):
        link.observe(2_000_000, 0.001 + 2_000_000 / 125e6)
    assert link.latency == 0.001 and link.rate == pytest.approx(125e6, rel=1e-3)
    link.observe(2_000_000, 0.001 + 2_000_000 / 2.5e6)  # 1 Gbit/s dropped to 20 Mbit/s
    assert link.rate < 10e6  # one slow read moves it most of the way (seconds per byte are averaged)


def test_bad_reads_are_ignored_and_bad_settings_refused():
    link = LinkEstimate(first=1e6)
    link.observe(0, 1.0)
    link.observe(100, 0.0)
    assert link.samples == 0 and link.rate == 1e6
    for kw in ({"first": 0.0}, {"first": 1.0, "first_latency": -1.0}, {"first": 1.0, "weight": 0.0}):
        with pytest.raises(ValueError):
            LinkEstimate(**kw)
    with pytest.raises(ValueError):
        link.seed(float("inf"), 0.0)


def test_local_tiers_are_trusted_and_remote_ones_are_not_until_measured(tmp_path):
    with open_store(f"memory://,{tmp_path / 'kv'}") as store:
        assert all(link.measured for link in store.read_estimates().values())
    link = LinkEstimate(125e6, 0.001)
    assert not link.measured
    link.seed(1e6, 0.01)
    assert link.measured and link.rate == 1e6 and link.latency == 0.01


def _session(link: LinkEstimate, n: int = 3, **kw) -> LoadSession:
    chunk = ChunkOptions(400, {ORDER[0]: 2_000_000, ORDER[1]: 1_500_000, ORDER[3]: 500_000})
    estimates = LoadEstimates(LoadConfig(recompute_tps=400.0, ttft_slack=None))
    return LoadSession([chunk] * n, ORDER, estimates, lambda: {"redis://far": link}, **kw)


def test_an_unmeasured_link_is_probed_with_the_first_chunks_smallest_level():
    link = LinkEstimate(125e6, 0.001)  # the first guess says 1 Gbit/s: level 0 would win
    session = _session(link)
    assert session.choose(0) == ORDER[3] and session.probed == 0
    link.observe(500_000, 2.0)  # the probe's read: 2 Mbit/s
    assert session.choose(1) is None  # text: 0.5 MB takes 2 s, recomputing 400 tokens 1 s
    assert session.report()["probe"] == 0
    ten = LinkEstimate(125e6, 0.0)
    ten.observe(500_000, 0.4)  # measured at 10 Mbit/s: level 0 takes 1.6 s, level 3 0.4 s, text 1 s
    again = _session(ten)
    assert again.choose(0) == ORDER[3] and again.probed is None


def test_a_measured_or_seeded_link_is_not_probed():
    link = LinkEstimate(125e6, 0.001)
    link.seed(125e6, 0.001)
    session = _session(link)
    assert session.choose(0) == ORDER[0] and session.probed is None
    one = _session(LinkEstimate(125e6, 0.001), n=1)  # a single chunk: nothing left to plan, no probe
    assert one.choose(0) == ORDER[0] and one.probed is None


def _book(tmp_path, store, estimates=None):
    return RateBook(tmp_path / "load_rates.json", store, estimates or LoadEstimates(), model="tiny@cpu")


def test_measured_speeds_are_kept_for_the_next_process(tmp_path):
    with open_store("memory://") as store:
        estimates = LoadEstimates()
        link = store.read_estimates()["memory://"]
        for nbytes in (1_000_000, 3_000_000) * 5:
            link.observe(nbytes, 0.002 + nbytes / 50e6)
        estimates.decode("cachegen:2").observe(1e6, 0.02)
        estimates.observe_prefill(1000, 1000, 2.5)
        estimates.observe_prefill(300, 1600, 1.0)  # mostly loaded: only the fixed cost moves
        estimates.decode_overlap.observe(3.0, 1.0)  # three decodes at once
        _book(tmp_path, store, estimates).save()
    data = json.loads((tmp_path / "load_rates.json").read_text())
    assert data["format"] == FORMAT and set(data["tiers"]) == {"memory://"}
    with open_store("memory://") as store:  # "the next process": fresh estimates, the same file
        fresh = LoadEstimates()
        assert _book(tmp_path, store, fresh).load() == 5
        link = store.read_estimates()["memory://"]
        assert link.rate == pytest.approx(50e6, rel=1e-3) and link.latency == pytest.approx(0.002, rel=1e-3)
        assert fresh.decode("cachegen:2").rate == pytest.approx(estimates.decode("cachegen:2").rate)
        assert fresh.recompute.rate == pytest.approx(estimates.recompute.rate)
        assert estimates.fusion_fixed.value > 0
        assert fresh.fusion_fixed.value == pytest.approx(estimates.fusion_fixed.value)
        assert (
            fresh.decode_overlap.rate == pytest.approx(estimates.decode_overlap.rate) and fresh.decode_overlap.rate > 1
        )


@pytest.mark.parametrize(
    "content",
    [
        "not json {",
        json.dumps(["a list"]),
        json.dumps({"format": "something-else", "tiers": {"memory://": {"rate_bps": 5.0, "latency_s": 0}}}),
        json.dumps(
            {
                "format": FORMAT,
                "tiers": {"memory://": {"rate_bps": -5.0, "latency_s": 0}},
                "decode": {"cachegen:0": "fast"},
                "models": {"tiny@cpu": {"recompute_tps": 0, "fusion_fixed_s": -1, "decode_overlap": 0.5}},
            }
        ),
        json.dumps({"format": FORMAT, "tiers": [1, 2], "decode": None, "models": "x"}),
    ],
)
def test_a_damaged_or_foreign_file_is_ignored_and_overwritten(tmp_path, content):
    (tmp_path / "load_rates.json").write_text(content)
    with open_store("memory://") as store:
        estimates = LoadEstimates()
        book = _book(tmp_path, store, estimates)
        assert book.load() == 0
        assert store.read_estimates()["memory://"].samples == 0 and estimates.recompute.samples == 0
        store.read_estimates()["memory://"].observe(1000, 0.001)
        book.save()  # the bad parts are dropped, the new measurement written
    data = json.loads((tmp_path / "load_rates.json").read_text())
    assert data["format"] == FORMAT and data["tiers"]["memory://"]["rate_bps"] > 0


def test_speeds_from_another_model_are_not_taken(tmp_path):
    with open_store("memory://") as store:
        estimates = LoadEstimates()
        estimates.observe_prefill(1000, 1000, 2.0)
        RateBook(tmp_path / "load_rates.json", store, estimates, model="big@cuda").save()
        other = LoadEstimates()
        assert _book(tmp_path, store, other).load() == 0 and other.recompute.samples == 0


def test_an_unwritable_data_dir_only_loses_the_speeds(tmp_path, caplog):
    with open_store("memory://") as store:
        store.read_estimates()["memory://"].observe(1000, 0.001)
        book = RateBook(tmp_path / "missing-dir" / "load_rates.json", store, LoadEstimates(), model="tiny@cpu")
        book.save()  # the folder does not exist: logged, nothing raised
        assert book.load() == 0
    assert "could not save load speeds" in caplog.text


def test_decodes_that_overlap_raise_the_overlap_estimate_and_starved_ones_count_as_one():
    session = _session(LinkEstimate(125e6, 0.001), decode_workers=4)
    overlap = session.estimates.decode_overlap
    assert overlap.rate == 1.0 and session.rates().decode_overlap == 1.0
    session.decodes_overlapped([(0.0, 1.0)])  # one decode says nothing about overlap
    assert overlap.samples == 0
    for _ in range(40):
        session.decodes_overlapped([(0.0, 1.0), (0.0, 1.0), (1.0, 2.0), (1.0, 2.0)])  # two at a time
    assert overlap.rate == pytest.approx(2.0, rel=1e-3) and session.rates().decode_overlap == overlap.rate
    one_thread = _session(LinkEstimate(125e6, 0.001))  # an overlap measured with more threads does not apply
    one_thread.estimates.decode_overlap = overlap
    assert one_thread.rates().decode_overlap == 1.0
    for _ in range(40):
        session.decodes_overlapped([(0.0, 1.0), (3.0, 4.0)])  # waiting on their fetches: busy 2 s of 4
    assert overlap.rate == pytest.approx(1.0, rel=1e-3)
