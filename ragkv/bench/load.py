"""``ragkv bench load``: how long a process takes to have a model ready, first (converting) and after.

Each load runs in a fresh process (what a user's next command pays), against a conversion cache in a
temporary folder that starts empty, so the first load converts and the second reads the entry. Both
report wall time and peak resident memory; the dtype is the one ``auto`` (or ``--dtype``) picks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["run_load_bench"]

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from ragkv.model import load_model
adapter = load_model(sys.argv[1], dtype=sys.argv[2])
seconds = time.perf_counter() - t0
from ragkv.model.placement import dtype_name
print(json.dumps({"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "dtype": dtype_name(adapter.dtype), "dtype_reason": adapter.dtype_reason}))
"""


def _one_load(model: str, dtype: str, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "RAGKV_MODEL_CACHE": str(cache), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, model, dtype], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"loading {model} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_load_bench(model: str, dtype: str = "auto", repeats: int = 1) -> list[dict[str, Any]]:
    """Rows ``{model, load, seconds, peak_rss_mb, dtype}``: one first load, then ``repeats`` later loads."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragkv-load-bench-") as tmp:
        cache = Path(tmp)
        for i in range(1 + repeats):
            row = _one_load(model, dtype, cache)
            rows.append({"model": Path(model).name, "load": "first (converts)" if i == 0 else "later", **row})
    return rows
