#!/usr/bin/env bash
# The device check (issue 34): `ragkv bench gpu` at 4K/16K/32K tokens, every CUDA test, the host's
# decode threads (experiments/decode_threads.py), the SDPA kernel torch picks for the recompute's
# masked attention with shared key heads (experiments/gpu_sdpa_choice.py), then the profile of one
# fused request (experiments/gpu_profile.py), on a lent GPU machine, within the device tool's 600 s a
# call (the timeouts sum to 590). Packages that machine lacks (and ragkv itself, as a wheel) may be carried in
# .whl/: they are installed into /tmp/site first. Results go to $OUT (or /tmp/ragkv-gpu).
#   bash tools/gpu_check.sh [extra args for ragkv bench gpu]
set -uo pipefail
OUT=${OUT:-/tmp/ragkv-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
timeout "${BENCH_TIMEOUT:-280}" python3 -m ragkv.bench.gpu --json "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/bench.log"
timeout "${TEST_TIMEOUT:-190}" python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu tests/model/test_gpu.py tests/model/test_lean.py tests/codec/test_roundtrip.py 2>&1 | tee "$OUT/tests.log" | tail -40
timeout "${DECODE_TIMEOUT:-45}" python3 experiments/decode_threads.py --workers 1,8 --repeats 3 2>&1 | tee "$OUT/decode_threads.txt"
timeout "${SDPA_TIMEOUT:-15}" python3 experiments/gpu_sdpa_choice.py 2>&1 | tee "$OUT/sdpa_choice.txt"
timeout "${PROFILE_TIMEOUT:-60}" python3 experiments/gpu_profile.py --out "$OUT" > "$OUT/profile.txt" 2>&1
head -30 "$OUT/profile.txt"
