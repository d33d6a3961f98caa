#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every GPU path once, by value, under one checked budget (540 s).
#
#   bash scripts/gpu_check.sh --prepare   where the package registries are reachable (this checkout installed):
#                                         downloads the wheels of scripts/gpu_wheels.txt for the lent machine's
#                                         Python and platform (scripts/gpu_machine.txt) into build/gpu/wheels, builds
#                                         the sdist-only ones, checks their tags, and copies SmolLM2's config and
#                                         tokenizer to build/gpu/smollm2 (a few MB in all; no weights)
#   bash scripts/gpu_check.sh [--out DIR] on the GPU machine (python3 with torch, transformers, ...; no internet):
#                                         installs those wheels into build/gpu/site, prints the versions, runs the
#                                         check; results in DIR (default $OUT where set, else build/gpu/check):
#                                         summary.json, versions.txt, logs.tar.gz. With the device tool:
#                                         run(command="bash scripts/gpu_check.sh", carry=["build/gpu"], timeout_s=600)
#   bash scripts/gpu_check.sh --dry-run   on any machine: the plan holds on the lent machine's packages
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then PY=.venv/bin/python; fi

case "${1:-}" in
  --dry-run)
    bash -n "$0"
    exec "$PY" -m scripts.gpu_check --dry-run
    ;;
  --prepare)
    rm -rf build/gpu/wheels build/gpu/smollm2 build/gpu/site build/gpu/check
    mkdir -p build/gpu/wheels
    pyver="$(sed -nE 's/^# python: *([0-9.]+).*/\1/p' scripts/gpu_machine.txt)"
    platform="$(sed -nE 's/^# platform: *([a-z0-9_]+).*/\1/p' scripts/gpu_machine.txt)"
    # wheels for the machine's Python and platform (never built by this machine's own Python); the releases that
    # have none ("# sdist" in gpu_wheels.txt, pure Python) are built here
    grep -E '^[A-Za-z0-9].*==' scripts/gpu_wheels.txt | grep -v '# sdist' | sed 's/ *#.*//' > build/gpu/binary.txt
    grep -E '# sdist' scripts/gpu_wheels.txt | sed 's/ *#.*//' > build/gpu/sdist.txt
    platforms=(--platform "$platform")
    for n in 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        "${platforms[@]}" -d build/gpu/wheels -r build/gpu/binary.txt
    if [[ -s build/gpu/sdist.txt ]]; then
      "$PY" -m pip wheel --quiet --no-deps -w build/gpu/wheels -r build/gpu/sdist.txt
    fi
    rm -f build/gpu/binary.txt build/gpu/sdist.txt
    "$PY" -m scripts.gpu_check --check-wheels build/gpu/wheels
    "$PY" -c "
import shutil; from pathlib import Path
from nemo_rcgrpo.models.hf import smollm2_model_dir
src, dst = smollm2_model_dir(), Path('build/gpu/smollm2'); dst.mkdir(parents=True)
for f in src.iterdir():
    if f.is_file() and not f.name.endswith('.safetensors') and not f.name.startswith('.'):
        shutil.copy(f, dst / f.name)
"
    ls build/gpu/wheels
    du -sh build/gpu
    exit 0
    ;;
esac

PY="${PYTHON:-python3}"  # the GPU machine's own interpreter (its torch); PYTHON=... to choose another
if [[ ! -d build/gpu/wheels ]]; then
  echo "error: build/gpu/wheels is missing; run 'bash scripts/gpu_check.sh --prepare' where the registries are reachable" >&2
  exit 2
fi
rm -rf build/gpu/site  # no packages of earlier wheels
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --target build/gpu/site build/gpu/wheels/*.whl
export PYTHONPATH="$PWD/build/gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NEMO_RCGRPO_CACHE="$PWD/build/gpu/cache"
"$PY" -c "
import importlib.metadata as m, sys
def v(d):
    try: return m.version(d)
    except m.PackageNotFoundError: return 'absent'
print('python', sys.version.split()[0], *(f'{d} {v(d)}' for d in ('pyarrow', 'fsspec', 'packaging', 'triton', 'torch',
      'transformers', 'datasets', 'megatron-core')), sep=' | ', flush=True)
"
exec "$PY" -m scripts.gpu_check "$@"
