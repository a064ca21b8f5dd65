#!/usr/bin/env bash
# `make spdk-check`: the SPDK backend's tests against real NVMe/TCP targets on loopback (SPDK
# built outside the repo as docs/kvio-spdk.md says; the module rebuilt with it). The engine's
# and handler's tests share one target started here; tests/kvpool/test_spdk.py starts, kills
# and restarts its own. Needs root (huge pages). On exit it gives back what the targets took
# (`spdk_nvmf_target.sh release`): vm.nr_hugepages as it found it, and /dev/hugepages
# unmounted if it was not mounted before.
set -euo pipefail
: "${SPDK_DIR:?set SPDK_DIR to the SPDK install prefix (bin/nvmf_tgt)}"
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export LD_LIBRARY_PATH="$SPDK_DIR/lib:${LD_LIBRARY_PATH:-}"  # the module and spdk_nvme_perf load SPDK's .so
"$PY" -c "from vllm_kvpool import _kvio; assert 'spdk' in _kvio.backends(), \
'the module was built without SPDK: rebuild with PKG_CONFIG_PATH=\$SPDK_DIR/lib/pkgconfig'"
state=$(mktemp -d /tmp/kvpool-spdk-check.XXXXXX)
pages_before=$(cat /proc/sys/vm/nr_hugepages)
mounted_before=$(mountpoint -q /dev/hugepages && echo 1 || echo 0)
release() {
  KVPOOL_TGT_DIR=$state bash scripts/spdk_nvmf_target.sh release "$pages_before" "$mounted_before"
  rm -rf "$state"
}
trap release EXIT
export KVPOOL_TGT_DIR=$state KVPOOL_TGT_PORT=4430
trid=$(bash scripts/spdk_nvmf_target.sh start | tail -1)
KVPOOL_SPDK_TRID="$trid" KVPOOL_SPDK_TARGET_CTL="$PWD/scripts/spdk_nvmf_target.sh" \
  "$PY" -m pytest -q -ra tests/kvio/test_kvio_spdk.py tests/kvpool/test_handlers.py -k spdk
bash scripts/spdk_nvmf_target.sh kill  # one polling target at a time on these cores
env -u KVPOOL_TGT_DIR -u KVPOOL_TGT_PORT "$PY" -m pytest -q -ra tests/kvpool/test_spdk.py
