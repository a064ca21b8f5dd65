"""Unpack what ``scripts/gpu_carry.sh`` put in ``.gpu-carry/`` on a machine with no registry.

* ``wheels/*.whl`` -> ``pip install --no-index --no-deps --target <site>`` (added to the parts'
  ``PYTHONPATH``, ahead of the image's own packages);
* ``debs/*.deb`` -> ``dpkg -x`` into a private prefix (never ``/``), the ``.pc`` files' ``prefix=``
  paths rewritten into that prefix, so CMake's ``pkg_check_modules(liburing)`` finds the carried
  liburing, and the prefix's ``pkg-config`` (pkgconf) used only where the machine has none.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MULTIARCH = "x86_64-linux-gnu"


class CarryError(RuntimeError):
    """The carried folder is missing something the run needs (named in the message)."""


def install_wheels(carry: Path, site: Path) -> list[str]:
    wheels = sorted((Path(carry) / "wheels").glob("*.whl"))
    if not wheels:
        raise CarryError(f"{carry}/wheels has no .whl files: run scripts/gpu_carry.sh first")
    site.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                    *map(str, wheels)], check=True)
    return [w.name for w in wheels]


def unpack_debs(carry: Path, prefix: Path) -> dict[str, str]:
    """``dpkg -x`` every carried .deb into ``prefix``; returns the environment a build needs
    (PKG_CONFIG_PATH, LD_LIBRARY_PATH, and PATH when pkg-config comes from the prefix)."""
    debs = sorted((Path(carry) / "debs").glob("*.deb"))
    if not any(d.name.startswith("liburing-dev_") for d in debs):
        raise CarryError(f"{carry}/debs has no liburing-dev .deb: run scripts/gpu_carry.sh first")
    if shutil.which("dpkg") is None:
        raise CarryError("dpkg is not installed: cannot unpack the carried .deb files")
    prefix.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        subprocess.run(["dpkg", "-x", str(deb), str(prefix)], check=True)
    pc_dirs = [prefix / "usr/lib" / MULTIARCH / "pkgconfig", prefix / "usr/share/pkgconfig"]
    for pc in (p for d in pc_dirs if d.is_dir() for p in d.glob("*.pc")):
        # Debian's .pc files spell libdir/includedir as absolute /usr paths, not ${prefix}/...
        text = re.sub(r"(?<=[=\s])/usr(?=/|\s|$)", f"{prefix}/usr", pc.read_text(), flags=re.M)
        pc.write_text(text)
    lib = prefix / "usr/lib" / MULTIARCH
    env = {
        "PKG_CONFIG_PATH": os.pathsep.join(str(d) for d in pc_dirs if d.is_dir()),
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(lib),
                                                         os.environ.get("LD_LIBRARY_PATH")])),
    }
    if shutil.which("pkg-config") is None and (prefix / "usr/bin/pkgconf").exists():
        env["PATH"] = os.pathsep.join([str(prefix / "usr/bin"), os.environ.get("PATH", "")])
    return env


def liburing_version(prefix: Path) -> str | None:
    pc = Path(prefix) / "usr/lib" / MULTIARCH / "pkgconfig/liburing.pc"
    if not pc.exists():
        return None
    m = re.search(r"^Version:\s*(\S+)", pc.read_text(), flags=re.M)
    return m.group(1) if m else None
