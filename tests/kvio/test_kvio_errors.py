"""Bad requests and failing devices raise KvioError naming device, offset and errno; no crash."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import LoopDevice, MiB

from vllm_kvpool import _kvio


@pytest.fixture
def dev(scratch: Path) -> Iterator[_kvio.Device]:
    with _kvio.Device(str(scratch / "dev.img"), capacity=16 * MiB, name="ssd0") as d:
        yield d


def test_scratch_filesystem_enforces_o_direct_alignment(scratch: Path) -> None:
    """Premise of the alignment tests: the kernel itself rejects misaligned O_DIRECT here."""
    path = scratch / "probe.img"
    path.write_bytes(b"\0" * 65536)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 8192)
        with pytest.raises(OSError) as e:
            os.preadv(fd, [memoryview(buf)[1:4097]], 0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("offset", "length", "host_shift", "what"),
    [(1, 4096, 0, "offset"), (4096, 100, 0, "length"), (4096, 4096, 1, "host address"),
     (0, 0, 0, "length is 0")],
)
def test_misaligned_requests_rejected(
    dev: _kvio.Device, pool: _kvio.HostPool, offset: int, length: int, host_shift: int, what: str
) -> None:
    for submit in (dev.submit_write, dev.submit_read):
        with pytest.raises(_kvio.AlignmentError) as e:
            submit([(0, pool.address, 4096), (offset, pool.address + host_shift, length)])
        assert e.value.device == "ssd0"
        assert e.value.offset == offset
        assert e.value.errno == errno.EINVAL
        assert what in str(e.value) and "ssd0" in str(e.value)
        assert isinstance(e.value, ValueError) and isinstance(e.value, OSError)
    # Nothing of the rejected batch was queued or written.
    assert dev.stats()["writes"] == 0 and dev.stats()["inflight"] == 0


def test_out_of_capacity(dev: _kvio.Device, pool: _kvio.HostPool) -> None:
    with pytest.raises(_kvio.KvioError) as e:
        dev.submit_write([(dev.capacity - 4096, pool.address, 8192)])
    assert e.value.errno == errno.ENOSPC and e.value.offset == dev.capacity - 4096
    with pytest.raises(_kvio.KvioError) as e:
        dev.submit_read([(dev.capacity, pool.address, 4096)])
    assert e.value.errno == errno.EINVAL


def test_device_allocator_full(dev: _kvio.Device) -> None:
    offs = [dev.alloc(2 * MiB) for _ in range(8)]
    assert sorted(offs) == [i * 2 * MiB for i in range(8)]
    assert dev.free_bytes == 0 and dev.used_bytes == dev.capacity
    with pytest.raises(_kvio.PoolFullError) as e:
        dev.alloc(4096)
    assert e.value.errno == errno.ENOSPC and "ssd0" in str(e.value)
    dev.free(offs[3])
    assert dev.alloc(2 * MiB) == offs[3]
    with pytest.raises(ValueError, match="not an allocated extent"):
        dev.free(12345)


def test_closed_device(dev: _kvio.Device, pool: _kvio.HostPool) -> None:
    t = dev.submit_write([(0, pool.address, MiB)])
    dev.close()  # drains in-flight I/O first
    assert dev.closed
    assert dev.wait(t)[0].ok
    with pytest.raises(_kvio.KvioError) as e:
        dev.submit_read([(0, pool.address, 4096)])
    assert e.value.errno == errno.EBADF and e.value.device == "ssd0"
    dev.close()  # idempotent


def test_truncated_file_is_short_read(dev: _kvio.Device, pool: _kvio.HostPool) -> None:
    [w] = dev.write([(8 * MiB, pool.address, MiB)])
    os.truncate(dev.path, 4 * MiB)  # the backing storage disappears under the device
    results = dev.read([(0, pool.address, MiB), (8 * MiB, pool.address + MiB, MiB, w.checksum)],
                       check=False)
    assert results[0].ok
    bad = results[1]
    assert bad.status == "error" and bad.errno == errno.EIO and bad.checksum == 0
    assert "short read" in bad.message and "ssd0" in bad.message and str(8 * MiB) in bad.message
    with pytest.raises(_kvio.KvioError) as e:
        dev.read([(8 * MiB, pool.address, MiB)])
    assert (e.value.device, e.value.offset, e.value.errno) == ("ssd0", 8 * MiB, errno.EIO)
    assert [r.status for r in e.value.results] == ["error"]


def test_shrinking_block_device(loop_device: LoopDevice, pool: _kvio.HostPool) -> None:
    """A block device that loses capacity: ENOSPC on write, short read, other chunks unharmed."""
    with _kvio.Device(loop_device.path, name="loop") as dev:
        np.frombuffer(pool, np.uint8)[: 2 * MiB] = 7
        good = dev.write([(0, pool.address, MiB), (16 * MiB, pool.address, MiB)])
        loop_device.resize(8 * MiB)
        results = dev.write([(MiB, pool.address, MiB), (20 * MiB, pool.address, MiB)],
                            check=False)
        assert results[0].ok
        assert results[1].status == "error" and results[1].errno == errno.ENOSPC
        # A chunk straddling the new end is partly written by the kernel, then fails: it must be
        # reported as an error, never as done.
        [straddle] = dev.write([(8 * MiB - 256 * 1024, pool.address, MiB)], check=False)
        assert straddle.status == "error" and straddle.errno == errno.ENOSPC
        assert straddle.checksum == 0
        with pytest.raises(_kvio.KvioError) as e:
            dev.read([(0, pool.address + 2 * MiB, MiB, good[0].checksum),
                      (16 * MiB, pool.address + 3 * MiB, MiB, good[1].checksum)])
        assert (e.value.device, e.value.offset) == ("loop", 16 * MiB)
        assert e.value.results[0].ok and e.value.results[1].status == "error"
        assert dev.stats()["errors"] == 3


def test_read_only_block_device(loop_device: LoopDevice, pool: _kvio.HostPool) -> None:
    with _kvio.Device(loop_device.path, name="loop") as dev:
        subprocess.run(["blockdev", "--setro", loop_device.path], check=True)
        try:
            with pytest.raises(_kvio.KvioError) as e:
                dev.write([(MiB, pool.address, MiB)])
            assert e.value.errno in (errno.EPERM, errno.EROFS, errno.EIO)
            assert e.value.offset == MiB
        finally:
            subprocess.run(["blockdev", "--setrw", loop_device.path], check=True)


def test_fallocate_enospc(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root/CAP_SYS_ADMIN)")
    try:
        path = mnt / "too-big.img"
        with pytest.raises(_kvio.KvioError) as e:
            _kvio.Device(str(path), capacity=64 * MiB, backend="posix")
        assert e.value.errno == errno.ENOSPC and str(path) in str(e.value)
        assert not path.exists()  # the half-allocated file was removed
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_bad_device_arguments(scratch: Path, shm_dir: Path) -> None:
    with pytest.raises(ValueError, match="backend 'nvme-magic'"):
        _kvio.Device(str(scratch / "x.img"), capacity=MiB, backend="nvme-magic")
    if "spdk" not in _kvio.backends():
        with pytest.raises(ValueError, match="not compiled"):
            _kvio.Device("trtype:TCP traddr:127.0.0.1", backend="spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        _kvio.Device(str(scratch / "x.img"), capacity=MiB, queue_depth=0)
    with pytest.raises(_kvio.KvioError) as e:
        _kvio.Device(str(scratch / "missing.img"), create=False)
    assert e.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="capacity is 0"):
        _kvio.Device(str(scratch / "missing.img"))
    with pytest.raises(TypeError, match="op 1"):
        with _kvio.Device(str(shm_dir / "t.img"), capacity=MiB, backend="posix") as d:
            d.submit_write([(0, 0, 512), ("x", 0, 512)])


def _open_shared(path: str, barrier, rounds: int, out) -> None:
    from vllm_kvpool import _kvio as kvio

    errors = []
    for i in range(rounds):
        barrier.wait()
        try:
            kvio.Device(f"{path}.{i}", capacity=4 * MiB, name="ssd0").close()
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(str(exc))
    out.put(errors)


def test_processes_racing_to_create_one_file_all_open_it(scratch: Path) -> None:
    """The ranks of one engine can open a shared file at once (an MLA layout stored once): a
    rank that loses the race to create it opens the file the winner made (no EEXIST), and
    the file is kept whole."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out, rounds = ctx.Barrier(2), ctx.Queue(), 12
    procs = [ctx.Process(target=_open_shared, args=(str(scratch / "shared.img"), barrier,
                                                    rounds, out)) for _ in range(2)]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in out.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    assert errors == []
    assert all((scratch / f"shared.img.{i}").stat().st_size >= 4 * MiB for i in range(rounds))
