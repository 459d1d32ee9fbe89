"""End to end over a kernel-limited link: a real redis-server and the engine in a private network
namespace with a tbf qdisc on loopback (skipped where the process cannot make one; CI runs as root)."""

from __future__ import annotations

import json

import pytest

from ragkv.bench import netns

PROBLEM = netns.namespace_problem()


@pytest.mark.skipif(PROBLEM is not None, reason=f"no rate-limited network namespace here: {PROBLEM}")
def test_a_tight_deadline_at_a_low_rate_picks_cheaper_levels_or_text_and_still_answers(tmp_path):
    out = tmp_path / "result.json"
    code = netns.reexec_inside(["-m", "tests.planner.limited_link_worker", str(out), "10"])
    assert code == 0
    got = json.loads(out.read_text())
    tight = got["tight"]
    assert tight["tokens"] > 0 and isinstance(tight["load"]["deadline_met"], bool)
    assert tight["load"]["choices"] and all(c in ("cachegen:3", "text", "local") for c in tight["load"]["choices"])
    # every chunk recomputed from text: the answer is full prefill's, and nothing crossed the link
    assert got["all_text"]["load"]["choices"] == ["text"] * 3 and got["all_text"]["bytes"] == 0
    assert got["all_text"]["text"] == got["full"]["text"]
