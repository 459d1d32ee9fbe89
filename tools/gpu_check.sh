#!/usr/bin/env bash
# The device check (issue 34): `ragkv bench gpu` at 4K/16K/32K tokens, every CUDA test, the host's
# decode threads (experiments/decode_threads.py), the SDPA kernel torch picks for the recompute's
# masked attention with shared key heads (experiments/gpu_sdpa_choice.py), then the profile of one
# fused request (experiments/gpu_profile.py), on a lent GPU machine, within the device tool's 600 s a
# call (the timeouts sum to 570, the install and the run folder a few seconds more). Results go to $OUT (or /tmp/ragkv-gpu): 8 files, what a call brings back.
#
# That machine has torch and transformers but not all of ragkv's dependencies, and reaches no
# registry: make their wheels here first (`bash tools/gpu_wheels.sh`, into .whl/) and carry them:
#   run(command="bash tools/gpu_check.sh --repeats 2", carry=[".whl"], timeout_s=600)
# Nor is ragkv installed there: the checkout is laid out as installed (pyproject's package-dir:
# ragkv.codec is codec/, ...; tools/typecheck.py builds that tree) in a run folder, with the tests
# and experiments beside it, and everything runs from there. PYTHON picks the interpreter (python3).
#   bash tools/gpu_check.sh [extra args for ragkv bench gpu]
set -uo pipefail
OUT=${OUT:-/tmp/ragkv-gpu}
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the run goes on from another folder
RUN=${RAGKV_RUN_DIR:-/tmp/ragkv-run}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=/tmp/ragkv-site
if ls .whl/*.whl >/dev/null 2>&1; then  # one wheel per Python version: pip takes the one that fits
  names=$(ls .whl/*.whl | xargs -n1 basename | sed 's/-.*//' | sort -u)
  # shellcheck disable=SC2086  # one argument per package name
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    --find-links .whl $names; then
    v=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "gpu_check: the carried wheels (.whl/) do not fit this Python ($v): run 'bash tools/gpu_wheels.sh $v' where PyPI is reached, and carry .whl again" >&2
    exit 1
  fi
else
  echo "gpu_check: no wheels carried (.whl/): a lent machine lacks zstandard and four more; see tools/gpu_wheels.sh" >&2
fi
rm -rf "$RUN" && "$PY" tools/typecheck.py --layout "$RUN" >/dev/null || exit 1
for d in tests experiments tools docs pyproject.toml; do cp -r "$d" "$RUN/" || exit 1; done
cd "$RUN" || exit 1
export PYTHONPATH=$RUN:$SITE PYTHONNOUSERSITE=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
# 16K first: the issue's headline row is measured even if the time limit stops the run at 32K
# (rows print as they are measured; a --contexts among the arguments wins; --tiny keeps its own);
# comparison columns skipped after 200 s, so that the last row's main columns fit the 280 s
order=(--contexts 16384,4096,32768 --budget-s "${BENCH_BUDGET:-200}")
case " $* " in *" --tiny "*) order=() ;; esac
timeout "${BENCH_TIMEOUT:-280}" "$PY" -m ragkv.bench.gpu --json "$OUT/gpu.json" ${order[@]+"${order[@]}"} "$@" 2>&1 |
  tee "$OUT/bench.log"
timeout "${TEST_TIMEOUT:-180}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu tests/model/test_gpu.py tests/model/test_lean.py tests/codec/test_roundtrip.py 2>&1 | tee "$OUT/tests.log" | tail -40
timeout "${DECODE_TIMEOUT:-45}" "$PY" experiments/decode_threads.py --workers 1,8 --repeats 3 2>&1 | tee "$OUT/decode_threads.txt"
timeout "${SDPA_TIMEOUT:-15}" "$PY" experiments/gpu_sdpa_choice.py 2>&1 | tee "$OUT/sdpa_choice.txt"
timeout "${PROFILE_TIMEOUT:-50}" "$PY" experiments/gpu_profile.py --out "$OUT" > "$OUT/profile.txt" 2>&1
head -30 "$OUT/profile.txt"
