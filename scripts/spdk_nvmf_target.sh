#!/usr/bin/env bash
# A local NVMe/TCP test target (SPDK nvmf_tgt over a RAM "malloc" bdev) for the SPDK backend's
# tests and benchmark. SPDK itself is built outside this repository (docs/kvio-spdk.md); this
# script only starts/stops its target. Needs root and reserved huge pages.
#
#   SPDK_DIR=/opt/spdk/install scripts/spdk_nvmf_target.sh start   # prints the KVPOOL_SPDK_TRID
#   scripts/spdk_nvmf_target.sh kill      # SIGKILL (a crash), stale huge page files removed
#   scripts/spdk_nvmf_target.sh stop      # SIGTERM
#   scripts/spdk_nvmf_target.sh release PAGES MOUNTED   # kill, then give back what `start` took:
#       vm.nr_hugepages down to PAGES, /dev/hugepages unmounted unless MOUNTED is 1 (both as
#       they were before the first `start`; spdk_check.sh and spdk_docs_check.py on exit)
#
# Environment: SPDK_DIR (install prefix with bin/nvmf_tgt; rpc.py is looked up under it and
# SPDK_SRC), KVPOOL_TGT_DIR (state dir, default /tmp/kvpool-nvmf), KVPOOL_TGT_MALLOC_MIB (1024),
# KVPOOL_TGT_CORE_MASK (0x2), KVPOOL_TGT_PORT (4420), KVPOOL_TGT_MEM_MIB (DPDK memory reserved
# up front; default: grown on demand), KVPOOL_HUGEPAGES (2 MiB pages the target and one
# initiator need together; default MALLOC_MIB / 2 + 900: 1412 for 1 GiB, 1668 for 1.5 GiB).
# `start` raises vm.nr_hugepages to that if it is lower (never lowers it).
set -euo pipefail

DIR=${KVPOOL_TGT_DIR:-/tmp/kvpool-nvmf}
MALLOC_MIB=${KVPOOL_TGT_MALLOC_MIB:-1024}
MASK=${KVPOOL_TGT_CORE_MASK:-0x2}
PORT=${KVPOOL_TGT_PORT:-4420}
MEM_ARGS=()
[ -n "${KVPOOL_TGT_MEM_MIB:-}" ] && MEM_ARGS=(-s "$KVPOOL_TGT_MEM_MIB")
NQN=nqn.2016-06.io.spdk:cnode1
mkdir -p "$DIR"

rpc_py() {
  local c
  for c in "${SPDK_DIR:-}/scripts/rpc.py" "${SPDK_SRC:-}/scripts/rpc.py" \
           "${SPDK_DIR:-}/../src/scripts/rpc.py"; do
    [ -f "$c" ] && { echo "$c"; return; }
  done
  echo "rpc.py not found: set SPDK_SRC to the SPDK source tree" >&2
  exit 1
}

pid() { [ -f "$DIR/nvmf_tgt.pid" ] && cat "$DIR/nvmf_tgt.pid" || true; }

ensure_hugepages() {  # the RAM bdev, the target's and one initiator's DPDK memory
  local need=${KVPOOL_HUGEPAGES:-$((MALLOC_MIB / 2 + 900))} have
  have=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$have" -lt "$need" ]; then
    echo "$need" >/proc/sys/vm/nr_hugepages 2>/dev/null || {
      echo "need $need huge pages (vm.nr_hugepages is $have): run as root" >&2; exit 1; }
    have=$(cat /proc/sys/vm/nr_hugepages)
    [ "$have" -ge "$need" ] || {
      echo "only $have of $need huge pages could be reserved (memory fragmented?)" >&2; exit 1; }
  fi
}

clean_hugepages() {  # files of a killed target keep their huge pages reserved
  local p=$1
  [ -n "$p" ] && rm -f /dev/hugepages/spdk_pid"${p}"map_* 2>/dev/null || true
}

case "${1:-}" in
  start)
    : "${SPDK_DIR:?set SPDK_DIR to the SPDK install prefix}"
    ensure_hugepages
    mountpoint -q /dev/hugepages || { mkdir -p /dev/hugepages && mount -t hugetlbfs -o pagesize=2M nodev /dev/hugepages; }
    rm -f "$DIR/nvmf.sock"
    LD_LIBRARY_PATH="$SPDK_DIR/lib:${LD_LIBRARY_PATH:-}" "$SPDK_DIR/bin/nvmf_tgt" -m "$MASK" \
      "${MEM_ARGS[@]}" -r "$DIR/nvmf.sock" >>"$DIR/nvmf_tgt.log" 2>&1 &
    echo $! >"$DIR/nvmf_tgt.pid"
    RPC="python3 $(rpc_py) -s $DIR/nvmf.sock -t 30"
    for _ in $(seq 100); do [ -S "$DIR/nvmf.sock" ] && break; sleep 0.1; done
    $RPC framework_wait_init >/dev/null
    $RPC nvmf_create_transport -t TCP >/dev/null
    $RPC bdev_malloc_create -b Malloc0 "$MALLOC_MIB" 4096 >/dev/null
    $RPC nvmf_create_subsystem "$NQN" -a -s SPDK00000000000001 -d kvpool >/dev/null
    $RPC nvmf_subsystem_add_ns "$NQN" Malloc0 >/dev/null
    $RPC nvmf_subsystem_add_listener "$NQN" -t tcp -a 127.0.0.1 -s "$PORT" >/dev/null
    echo "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN"
    ;;
  kill | stop)
    p=$(pid)
    if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then
      kill "$([ "$1" = kill ] && echo -KILL || echo -TERM)" "$p"
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    fi
    clean_hugepages "$p"
    rm -f "$DIR/nvmf_tgt.pid" "$DIR/nvmf.sock"
    ;;
  release)
    pages_before=${2:?release PAGES MOUNTED: vm.nr_hugepages and the mount as they were before}
    mounted_before=${3:?release PAGES MOUNTED: 1 if /dev/hugepages was mounted before}
    bash "$0" kill || true
    if [ "$(cat /proc/sys/vm/nr_hugepages)" -gt "$pages_before" ]; then
      echo "$pages_before" >/proc/sys/vm/nr_hugepages \
        && echo "spdk target: vm.nr_hugepages back to $pages_before" >&2 \
        || echo "spdk target: could not set vm.nr_hugepages back to $pages_before" >&2
    fi
    if [ "$mounted_before" != 1 ] && mountpoint -q /dev/hugepages; then
      umount /dev/hugepages && echo "spdk target: /dev/hugepages unmounted" >&2 \
        || echo "spdk target: could not unmount /dev/hugepages (in use?)" >&2
    fi
    ;;
  status)
    p=$(pid)
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null && echo "running (pid $p)" || { echo stopped; exit 1; }
    ;;
  *)
    echo "usage: $0 start|stop|kill|status|release PAGES MOUNTED" >&2
    exit 2
    ;;
esac
