"""``--slo-ms``: not given leaves the default (no deadline); given, it sets EngineConfig.load.slo_ms."""

from __future__ import annotations

from ragkv.cli.options import engine_config
from tests.core.test_cli import one_line_error, run


def test_slo_ms_overrides_only_when_given():
    assert engine_config().load.slo_ms is None
    assert engine_config(slo_ms=250.0).load.slo_ms == 250.0


def test_a_non_positive_deadline_is_refused(monkeypatch, capsys, tmp_path):
    code, _, err = run(monkeypatch, capsys, "ask", "q?", "--data-dir", str(tmp_path), "--slo-ms", "0")
    assert "slo_ms" in one_line_error(code, err)
