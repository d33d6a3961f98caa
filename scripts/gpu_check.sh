#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every GPU path once, in priority order, in under 9 minutes.
#
#   bash scripts/gpu_check.sh --prepare   on a machine with the package registries (this checkout installed):
#                                         downloads the wheels of scripts/gpu_wheels.txt for Python 3.12 into
#                                         build/gpu/wheels and copies SmolLM2's config and tokenizer to
#                                         build/gpu/smollm2 (a few MB in all; no weights)
#   bash scripts/gpu_check.sh [--out DIR] on the GPU machine (python3 with pip, torch, transformers, accelerate,
#                                         safetensors; no internet): installs those wheels into build/gpu/site, runs
#                                         the check, writes DIR/summary.json and one log per step (default
#                                         build/gpu/check). build/ is git-ignored: copy build/gpu with the checkout.
#   bash scripts/gpu_check.sh --dry-run   on any machine: validates the plan (configs, imports, wheel pins)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then PY=.venv/bin/python; fi

case "${1:-}" in
  --dry-run)
    bash -n "$0"
    exec "$PY" scripts/gpu_check.py --dry-run
    ;;
  --prepare)
    rm -rf build/gpu/wheels build/gpu/smollm2
    mkdir -p build/gpu/wheels
    # megatron-core has a compiled part: its CPython 3.12 wheel; the others are pure Python (antlr4's 4.9.3 is a
    # source release only, built into a wheel here)
    grep -E '^megatron-core==' scripts/gpu_wheels.txt > build/gpu/binary.txt
    grep -vE '^(#|megatron-core==|$)' scripts/gpu_wheels.txt > build/gpu/pure.txt
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --implementation cp \
        -d build/gpu/wheels -r build/gpu/binary.txt
    "$PY" -m pip wheel --quiet --no-deps -w build/gpu/wheels -r build/gpu/pure.txt
    "$PY" -c "
import shutil; from pathlib import Path
from nemo_rcgrpo.models.hf import smollm2_model_dir
src, dst = smollm2_model_dir(), Path('build/gpu/smollm2'); dst.mkdir(parents=True)
for f in src.iterdir():
    if f.is_file() and not f.name.endswith('.safetensors') and not f.name.startswith('.'):
        shutil.copy(f, dst / f.name)
"
    du -sh build/gpu/wheels build/gpu/smollm2
    exit 0
    ;;
esac

PY="${PYTHON:-python3}"  # the GPU machine's own interpreter (its torch); PYTHON=... to choose another
if [[ ! -d build/gpu/wheels ]]; then
  echo "error: build/gpu/wheels is missing; run 'bash scripts/gpu_check.sh --prepare' where the registries are reachable" >&2
  exit 2
fi
rm -rf build/gpu/site  # no packages of earlier wheels
"$PY" -m pip install --quiet --no-index --no-deps --target build/gpu/site build/gpu/wheels/*.whl
export PYTHONPATH="$PWD/build/gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NEMO_RCGRPO_CACHE="$PWD/build/gpu/cache"
exec "$PY" scripts/gpu_check.py "$@"
