"""Fixtures for the I/O engine tests: scratch files on a real filesystem, loop devices, pools."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kvpool import _kvio

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding `path` (longest matching mount point)."""
    best, kind = "", "?"
    real = str(path.resolve())
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fstype, *_ = line.split()
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


@pytest.fixture(scope="session")
def scratch_root() -> Iterator[Path]:
    """A directory under the repo's .tmp/ (git-ignored) on a filesystem that enforces O_DIRECT.

    Not /dev/shm: tmpfs accepts misaligned O_DIRECT and would hide alignment bugs.
    """
    root = REPO / ".tmp" / f"kvio-tests-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    kind = fs_type(root)
    if kind in ("tmpfs", "ramfs", "overlay"):
        shutil.rmtree(root)
        pytest.skip(f"{REPO / '.tmp'} is on {kind}, which does not enforce O_DIRECT alignment")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def scratch(scratch_root: Path, request: pytest.FixtureRequest) -> Path:
    d = scratch_root / request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
    d.mkdir()
    return d


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on tmpfs, for the posix backend."""
    d = Path("/dev/shm") / f"kvio-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool() -> _kvio.HostPool:
    return _kvio.HostPool(64 * MiB, name="test")


class LoopDevice:
    """A loop device with direct I/O on a backing file; detached on close."""

    def __init__(self, backing: Path, size: int) -> None:
        self.backing = backing
        with open(backing, "wb") as f:
            f.truncate(size)
        self.path = subprocess.run(
            ["losetup", "--direct-io=on", "--find", "--show", str(backing)],
            check=True, capture_output=True, text=True,
        ).stdout.strip()

    def resize(self, size: int) -> None:
        os.truncate(self.backing, size)
        subprocess.run(["losetup", "--set-capacity", self.path], check=True)

    def close(self) -> None:
        subprocess.run(["losetup", "-d", self.path], check=False, capture_output=True)


def loop_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "losetup needs root"
    if shutil.which("losetup") is None:
        return "losetup is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "/dev/loop-control missing (no loop driver in this kernel/container)"
    return None


@pytest.fixture
def loop_device(scratch: Path) -> Iterator[LoopDevice]:
    reason = loop_unavailable_reason()
    if reason:
        pytest.skip(f"loop device test skipped: {reason}")
    try:
        dev = LoopDevice(scratch / "loop-backing.img", 32 * MiB)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"losetup --direct-io=on not permitted here: {e.stderr.strip()}")
    try:
        yield dev
    finally:
        dev.close()
