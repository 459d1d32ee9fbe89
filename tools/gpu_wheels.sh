#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into .whl/ (git-ignored), for tools/gpu_check.sh to install there.
#
# The device's image has torch, transformers, numpy, xxhash, pytest and hypothesis, but none of the
# ragkv dependencies below, and it reaches no package registry (library: device/KINDS.md, "Python
# packages already there"). Run this here, where PyPI is reached, then name .whl in the run's carry:
#
#   bash tools/gpu_wheels.sh              # binary wheels for CPython 3.12 and 3.13 on x86-64 Linux
#   bash tools/gpu_wheels.sh 3.11         # or for the versions named
#   run(command="bash tools/gpu_check.sh --repeats 2", carry=[".whl"], timeout_s=600)
#
# Only what the check imports: the codecs' zstandard and constriction; the catalog's SQLAlchemy, the
# index's FAISS and the disk tier's diskcache (the CUDA tests build engines and stores). .whl/ is
# emptied first. ragkv itself is not a wheel here: gpu_check.sh lays the checkout out as installed
# (tools/typecheck.py --layout), so the run is of the tree that travelled.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-$(command -v .venv/bin/pip || command -v pip3)}
VERSIONS=${*:-3.12 3.13}
PACKAGES=(zstandard constriction sqlalchemy faiss-cpu diskcache)
rm -rf .whl && mkdir -p .whl
for v in $VERSIONS; do
  "$PIP" download -q --only-binary=:all: --no-deps -d .whl --python-version "$v" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${PACKAGES[@]}"
done
ls -l .whl
du -sh .whl
