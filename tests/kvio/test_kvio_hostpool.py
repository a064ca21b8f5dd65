"""Host pools: alignment, zero-copy buffer views, allocator accounting, clear errors."""

from __future__ import annotations

import errno
import gc
import logging

import numpy as np
import pytest
import torch
from conftest import MiB

from vllm_kvpool import _kvio


def test_pool_is_aligned_and_zero_copy() -> None:
    pool = _kvio.HostPool(5 * MiB, numa_node=_kvio.numa_nodes()[0], name="p")
    assert pool.capacity == 6 * MiB  # rounded up to 2 MiB
    assert pool.address % (2 * MiB) == 0
    assert len(pool) == pool.capacity
    arr = np.frombuffer(pool, np.uint8)
    assert arr.ctypes.data == pool.address and arr.size == pool.capacity and arr.flags.writeable
    t = torch.frombuffer(pool, dtype=torch.uint8)
    assert t.data_ptr() == pool.address
    arr[123] = 42
    assert t[123].item() == 42 and memoryview(pool)[123] == 42
    v = pool.view(MiB, 16)
    v[0] = 7
    assert arr[MiB] == 7
    with pytest.raises(ValueError, match="outside the pool"):
        pool.view(pool.capacity - 8, 16)


def test_views_keep_the_pool_alive() -> None:
    pool = _kvio.HostPool(2 * MiB)
    view = pool.view(0, 4096)
    arr = np.frombuffer(pool, np.uint8)
    del pool
    gc.collect()
    view[0] = 1  # would crash if the mapping had been freed
    arr[-1] = 2
    assert view[0] == 1 and arr[-1] == 2


def test_allocator_accounting_and_full_error() -> None:
    pool = _kvio.HostPool(4 * MiB, name="small")
    a = pool.alloc(MiB)
    b = pool.alloc(100, alignment=65536)
    assert a % 4096 == 0 and b % 65536 == 0
    assert pool.used_bytes == MiB + 65536 and pool.allocations == 2
    assert pool.free_bytes == pool.capacity - pool.used_bytes
    with pytest.raises(_kvio.PoolFullError) as e:
        pool.alloc(4 * MiB)
    assert e.value.errno == errno.ENOSPC and "small" in str(e.value)
    assert isinstance(e.value, MemoryError)
    pool.free(a)
    pool.free(b)
    assert pool.used_bytes == 0 and pool.largest_free == pool.capacity
    with pytest.raises(ValueError):
        pool.free(a)


def test_hugepage_fallback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with open("/proc/sys/vm/nr_hugepages") as f:
        configured = int(f.read())
    with caplog.at_level(logging.DEBUG, logger="vllm_kvpool.kvio"):
        pool = _kvio.HostPool(2 * MiB, hugepages=True)
    if configured == 0:
        assert not pool.hugepages
        assert "huge pages unavailable" in pool.note
        # WARNING the first time in a process, DEBUG for later pools with the same reason.
        assert any("huge pages unavailable" in r.getMessage() for r in caplog.records)
    quiet = _kvio.HostPool(2 * MiB, hugepages=False)
    assert quiet.note == "" and not quiet.hugepages


def test_mlock_and_bad_numa_node() -> None:
    pool = _kvio.HostPool(2 * MiB, mlock=True)
    assert pool.mlocked or "mlock failed" in pool.note
    with pytest.raises(ValueError, match="numa_node 999"):
        _kvio.HostPool(2 * MiB, numa_node=999)
    with pytest.raises(ValueError, match="capacity"):
        _kvio.HostPool(0)
