#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the llama.cpp sources that llama-cpp-python's
# sdist vendors, for `ragkv bench goodput` (issue 37). The only download is the sdist from PyPI
# (through pip); cmake fetches nothing: no curl or OpenSSL, no tests or examples, and no web UI (newer
# llama.cpp would download a prebuilt one from Hugging Face; the bench needs only the HTTP API).
# Idempotent: when the binary exists it only prints its path. CI need not run it.
#   bash tools/build_llama_server.sh [DEST]      (default ~/.cache/ragkv/llama-server)
# Settings (environment): JOBS (default 2), NICE (default 19), PIP (default: python3 -m pip),
# LLAMA_CPP_PYTHON_VERSION (default: the newest sdist on PyPI), SDIST (a local .tar.gz to use).
# The last line printed is the binary's path; pass it as `ragkv bench goodput --llama-server PATH`
# or export RAGKV_LLAMA_SERVER=PATH.
set -euo pipefail

# One function, called on the last line: bash parses all of it before running any (an edit of this
# file during a 30-minute build cannot change what the running build does next).
main() {
  local DEST=${1:-${RAGKV_LLAMA_SERVER_DIR:-$HOME/.cache/ragkv/llama-server}}
  JOBS=${JOBS:-2}
  NICE=${NICE:-19}
  PIP=${PIP:-python3 -m pip}
  BIN="$DEST/bin/llama-server"

  if [[ -x "$BIN" ]]; then
    echo "llama-server already built (delete $DEST to rebuild)" >&2
    echo "$BIN"
    exit 0
  fi
  mkdir -p "$DEST"
  WORK="$DEST/build-work"
  mkdir -p "$WORK"

  # 1. The sdist (pip is the only network use; a local one may be given as SDIST).
  if [[ -n "${SDIST:-}" ]]; then
    tarball=$SDIST
  else
    spec=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
    tarball=$(ls "$WORK"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
    if [[ -z "$tarball" ]]; then
      echo "downloading the $spec sdist from PyPI" >&2
      $PIP download --quiet --no-deps --no-binary llama-cpp-python --dest "$WORK" "$spec" >&2
      tarball=$(ls "$WORK"/llama_cpp_python-*.tar.gz | head -1)
    fi
  fi
  echo "sdist: $tarball" >&2

  # 2. Unpack it (once) and find the vendored llama.cpp.
  src_root="$WORK/src"
  if [[ ! -d "$src_root" ]]; then
    mkdir -p "$src_root.tmp"
    tar -xzf "$tarball" -C "$src_root.tmp"
    mv "$src_root.tmp" "$src_root"
  fi
  llama=$(ls -d "$src_root"/*/vendor/llama.cpp | head -1)
  if [[ ! -d "$llama/tools/server" ]]; then
    echo "error: $llama has no tools/server (an sdist too old for this script?)" >&2
    exit 1
  fi

  # 3. Configure and build only the server target, CPU only, nothing fetched.
  build="$WORK/build"
  cmake -S "$llama" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENCL=OFF \
    -DGGML_CCACHE=OFF >&2
  nice -n "$NICE" cmake --build "$build" --config Release --target llama-server -j "$JOBS" >&2

  mkdir -p "$DEST/bin"
  cp "$build/bin/llama-server" "$BIN.tmp"
  mv "$BIN.tmp" "$BIN"
  echo "built llama-server from $(basename "$tarball") (work files stay in $WORK)" >&2
  echo "$BIN"
}

main "$@"
