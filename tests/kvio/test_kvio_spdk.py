"""SPDK backend round trip against a real NVMe target (NVMe/TCP loopback or PCIe).

Runs only when the module was built with SPDK and KVPOOL_SPDK_TRID names a reachable target, e.g.
  KVPOOL_SPDK_TRID='trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1'
SPDK itself is built outside this repository.
"""

from __future__ import annotations

import os
import re
import socket

import numpy as np
import pytest
from conftest import MiB

from vllm_kvpool import _kvio

TRID = os.environ.get("KVPOOL_SPDK_TRID", "")


def skip_reason() -> str | None:
    if "spdk" not in _kvio.backends():
        return "module built without SPDK (pkg-config found no spdk_nvme/spdk_env_dpdk)"
    if not TRID:
        return "KVPOOL_SPDK_TRID is not set"
    if "trtype:TCP" in TRID:
        addr = re.search(r"traddr:(\S+)", TRID)
        port = re.search(r"trsvcid:(\d+)", TRID)
        if not addr or not port:
            return f"cannot find traddr/trsvcid in KVPOOL_SPDK_TRID={TRID!r}"
        try:
            socket.create_connection((addr.group(1), int(port.group(1))), timeout=2).close()
        except OSError as e:
            return f"NVMe/TCP target {addr.group(1)}:{port.group(1)} unreachable: {e}"
    return None


pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def test_spdk_roundtrip_and_corruption() -> None:
    pool = _kvio.HostPool(16 * MiB, name="spdk")
    buf = np.frombuffer(pool, np.uint8)
    buf[: 8 * MiB] = np.random.default_rng(0).integers(0, 256, 8 * MiB, dtype=np.uint8)
    with _kvio.Device(TRID, backend="spdk", capacity=64 * MiB, name="spdk0") as dev:
        assert dev.kind == "spdk" and dev.alignment in (512, 4096)
        dev.register_host_pools([pool])
        written = dev.write([(i * MiB, pool.address + i * MiB, MiB) for i in range(8)])
        results = dev.read([(i * MiB, pool.address + 8 * MiB + i * MiB, MiB, w.checksum)
                            for i, w in enumerate(written)])
        assert all(r.ok for r in results)
        assert np.array_equal(buf[8 * MiB :], buf[: 8 * MiB])
        [bad] = dev.read([(0, pool.address + 8 * MiB, MiB, written[0].checksum ^ 1)], check=False)
        assert bad.status == "corrupt"
        with pytest.raises(_kvio.AlignmentError):
            dev.submit_read([(1, pool.address, MiB)])
        assert _kvio.probe_device(dev, seconds=0.5, pool=pool)["read_gbps"] > 0
