"""``scripts/gpu_carry.sh`` builds the folder a GPU run carries, within the device tool's 64 MiB,
and what it carries works there: the wheels are CPython 3.12 manylinux builds whose requirements
the GPU image already has, and CMake configures the C++ core against the carried liburing
unpacked into a private prefix (not the system's). Skipped, with the reason, when no package
index or Debian mirror answers."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gpucheck.carry import liburing_version, unpack_debs  # noqa: E402
from gpucheck.parts.kvio import build_kvio  # noqa: E402

LIMIT = 64 * 2**20
# Python packages of the lent GPU image (the device tool's package list for nvidia-h200) that the
# carried wheels require; anything else would be missing there.
GPU_IMAGE_PACKAGES = {"numpy", "scipy", "narwhals", "torch", "packaging"}


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("carry") / "gpu-carry"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_carry.sh"), str(dest)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"no registry answered: {proc.stderr.strip()[-300:]}")
    m = re.search(r"size: carry ([\d.]+) MiB \+ working tree ([\d.]+) MiB", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    carry_mib = float(m.group(1))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split("\0")
    tracked_bytes = sum((ROOT / f).stat().st_size for f in tracked if f and (ROOT / f).is_file())
    # the carried folder plus the committed tree must leave room (untracked files of a
    # developer's checkout are the script's warning, not this test's business)
    assert carry_mib * 2**20 + tracked_bytes < 0.75 * LIMIT, (carry_mib, tracked_bytes)
    assert proc.returncode in (0, 1), proc.stderr
    assert 'carry: ["' in proc.stdout
    return dest


@pytest.mark.slow
def test_wheels_are_cp312_manylinux_and_need_only_what_the_image_has(carry):
    wheels = sorted((carry / "wheels").glob("*.whl"))
    assert {w.name.split("-")[0].lower() for w in wheels} == {"lightgbm", "megatron_core"}
    for w in wheels:
        python_tag, abi, platform = w.stem.split("-")[-3:]
        assert python_tag in ("cp312", "py3") and "manylinux" in platform and "x86_64" in platform
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [line.split(":", 1)[1].strip() for line in
                        z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
        needed = {re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower()
                  for r in requires if "extra ==" not in r}
        assert needed <= GPU_IMAGE_PACKAGES, (w.name, needed - GPU_IMAGE_PACKAGES)


@pytest.mark.slow
def test_cmake_finds_the_carried_liburing_in_a_private_prefix(carry, tmp_path):
    prefix = tmp_path / "prefix"
    env = unpack_debs(carry, prefix)
    deb = next((carry / "debs").glob("liburing-dev_*.deb")).name
    assert liburing_version(prefix) == deb.split("_")[1].split("-")[0]
    facts = build_kvio(str(prefix), tmp_path / "build", tmp_path / "out", configure_only=True,
                       env=env)
    assert facts["from_prefix"], facts  # headers and library from the prefix, not /usr
    assert facts["liburing_version"] == liburing_version(prefix)
