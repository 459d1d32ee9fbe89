"""``ragkv bench gpu``: the same code on a tiny config on the CPU, and its refusal without CUDA.

No timing is asserted (speed goes to docs/benchmarks.md): only that every measurement runs and
lands in the table.
"""

from __future__ import annotations

import json
import math
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    from ragkv.bench import gpu

    return gpu


def test_a_tiny_run_fills_every_column(bench, capsys, tmp_path) -> None:
    out_json = tmp_path / "gpu.json"
    # the longer first, as tools/gpu_check.sh orders 16K before 4K: measured in that order, tabled by length
    rows = bench.main(["--tiny", "--contexts", "300,200", "--chunk", "32", "--repeats", "1", "--json", str(out_json)])
    assert [r["chunks"] for r in rows] == [4, 7] and [r["tokens"] for r in rows] == [176, 272]
    # rates measured on a GPU only (nan on the CPU)
    bounds = {"probe_bound_ms", "recompute_bound_ms", "recompute_work_bound_ms"}
    bounds |= {"pinned_ms", "pinned_speedup", "pinned_copy_gb_s"}  # page-locked memory needs CUDA
    bounds |= {"tier_attention_kernel_ms"}  # ragkv's attention kernel runs on a GPU only
    for row in rows:
        assert {c.key for c in bench.COLUMNS} <= row.keys()
        assert all(math.isfinite(v) for k, v in row.items() if k not in bounds and k != "attention_kernel")
        assert row["attention_kernel"] == "no" and math.isnan(row["tier_attention_kernel_ms"])  # a GPU's only
        assert row["token_passes"] > 0 and row["decode_ms"] > 0
        assert row["full_ms"] > 0 and row["host_ms"] > 0 and row["tier_ms"] > 0 and row["copy_gb_s"] > 0
        assert row["kl"] >= 0
    out = capsys.readouterr().out
    assert "| prompt tokens |" in out and "tiny, random weights" in out
    assert [r["chunks"] for r in json.loads(out_json.read_text())["rows"]] == [4, 7]
    # each row is out as soon as it is measured (a run stopped by its time limit keeps them)
    lines = [json.loads(line.removeprefix("row: ")) for line in out.splitlines() if line.startswith("row: ")]
    assert [r["tokens"] for r in lines] == [272, 176] and out.index("row: ") < out.index("| prompt tokens |")
    assert 0 < lines[0]["elapsed_s"] < lines[1]["elapsed_s"]


def test_it_refuses_cleanly_without_cuda(bench, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device.*--tiny"):
        bench.main([])


def test_the_full_size_shape_is_llama_3_1_8b(bench) -> None:
    from transformers import LlamaConfig

    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**bench.LLAMA_3_1_8B))
    params = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B: 8.03B parameters


def test_a_comparison_that_fails_leaves_its_column_nan_and_the_table_whole(bench, capsys, monkeypatch) -> None:
    """On a lent device one broken comparison column must not cost the run its table."""
    copy = bench._slab_copy

    def split_copy_fails(chunks, threads: int = 1) -> None:
        if threads > 1:
            raise RuntimeError("no thread for you")
        copy(chunks, threads)

    monkeypatch.setattr(bench, "_slab_copy", split_copy_fails)
    (row,) = bench.main(["--tiny", "--contexts", "200", "--chunk", "32", "--repeats", "1"])
    assert math.isnan(row["slab_threads_gb_s"])
    assert (
        math.isfinite(row["slab_gb_s"]) and math.isfinite(row["tier_ms"]) and math.isfinite(row["tier_whole_mask_ms"])
    )
    assert "host slab on threads failed (RuntimeError: no thread for you)" in capsys.readouterr().err


def test_past_its_budget_the_bench_skips_the_comparison_columns_only(bench, capsys) -> None:
    """``--budget-s``: a time-limited device run still measures every row's main columns."""
    extras = ("host_int8_ms", "slab_threads_gb_s", "host_threads_ms", "place_torch_ms", "probe_torch_ms")
    extras += ("probe_eager_ms", "tier_eager_ms", "tier_whole_mask_ms", "tier_whole_mask_peak_gib")
    main = ("full_ms", "host_ms", "tier_ms", "decode_ms", "copy_ms", "slab_gb_s", "place_ms", "probe_ms")
    main += ("recompute_ms", "tier_sdpa_attention_ms")  # the attention's columns always run
    (row,) = bench.main(["--tiny", "--contexts", "200", "--chunk", "32", "--repeats", "1", "--budget-s", "0"])
    assert all(math.isnan(row[k]) for k in extras), {k: row[k] for k in extras}
    assert all(math.isfinite(row[k]) for k in main), {k: row[k] for k in main}
    err = capsys.readouterr().err
    assert "whole masks skipped (past --budget-s)" in err and "probe eager skipped" in err
    # a budget that has not run out skips nothing
    (row,) = bench.main(["--tiny", "--contexts", "200", "--chunk", "32", "--repeats", "1", "--budget-s", "3600"])
    assert all(math.isfinite(row[k]) for k in extras) and "skipped" not in capsys.readouterr().err


def test_a_negative_budget_is_refused(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--budget-s", "-1"])


_PROFILE_SCRIPT = """
import gc, importlib.util, json, sys
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from ragkv.bench import gpu as bench
from ragkv.fusion import FusionConfig

spec = importlib.util.spec_from_file_location("gpu_profile", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
a = bench.build_model(bench.TINY, torch.device("cpu"), torch.float32)
p = bench._prompt(a.spec.vocab_size, 200, 32)
prefix = a.prefill_kv(p.prefix)
chunks = [a.prefill_kv(c, past=[prefix]) for c in p.chunks]
config = _ExperimentalConfig(verbose=True)
bench._fused(a, prefix, chunks, p, FusionConfig())  # warmed up: no code generated (and freed) in the profile
gc.collect()
gc.disable()  # nor a code object collected before the events are read back (as gpu_profile.py does)
with profile(activities=[ProfilerActivity.CPU], with_stack=True, experimental_config=config) as prof:
    bench._fused(a, prefix, chunks, p, FusionConfig())
totals = module.by_source(prof.events(), "self_cpu_time_total")
gc.enable()
own = sum(t for t in (ev.self_cpu_time_total for ev in prof.events() if ev.device_type == DeviceType.CPU) if t > 0)
print(json.dumps({"where": [list(k) for k in totals], "total": sum(totals.values()), "own": own}))
"""


def test_the_profile_groups_a_fusions_time_by_where_it_was_launched(tmp_path) -> None:
    """``experiments/gpu_profile.py``'s grouping, on a CPU profile of a tiny fusion (the device run groups
    device time the same way): every operator's own time once, by ragkv's innermost line and the
    innermost Python line.

    In a process of its own, as the device run profiles: once in a full suite's long-lived process
    torch's profiler failed to read its own events back (``UnicodeDecodeError`` in
    ``_parse_kineto_results``): its Python tracer keeps pointers into code objects' names, so a
    code object freed during the profile (most likely an earlier test's, by a garbage collection)
    leaves a name of freed bytes. A fault of torch's, not of the
    grouping; the profile here runs warmed up, with no collection until its events are read."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "profile_tiny.py"
    script.write_text(_PROFILE_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(root / "experiments" / "gpu_profile.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ours = {where.split("(")[0] for where, _ in got["where"]}
    assert {"ragkv/fusion.py", "ragkv/model/adapter.py"} <= ours
    assert any(inner.startswith("transformers/") for _, inner in got["where"])  # a modeling file's line
    assert got["total"] == pytest.approx(got["own"])  # each operator's own time once, none left out
