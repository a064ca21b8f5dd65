"""The SPDK link logic of CMakeLists.txt, checked without SPDK: fake pkg-config files shaped like
SPDK v25.09's (system libraries only in spdk_syslibs' Libs.private, SPDK libraries pulled in
through Requires) and the link lines CMake generates from them (configure only, nothing built).

SPDK's doc/pkgconfig.md: the SPDK libraries between -Wl,--no-as-needed and -Wl,--as-needed (their
constructors register the socket implementations and transports), then
`pkg-config --libs --static spdk_syslibs`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CMAKE = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def pc(name: str, libs: str, requires: str = "", private: str = "", version: str = "16.0") -> str:
    return (f"Description: fake {name}\nName: {name}\nVersion: {version}\nLibs: {libs}\n"
            f"Requires: {requires}\nLibs.private: {private}\nCflags: -I{{inc}}\n")


def fake_spdk(root: Path) -> Path:
    lib, inc = root / "lib", root / "include"
    (inc / "spdk").mkdir(parents=True)
    (lib / "pkgconfig").mkdir(parents=True)
    (inc / "spdk" / "version.h").write_text(
        "#define SPDK_VERSION_MAJOR\t25\n#define SPDK_VERSION_MINOR\t9\n#define SPDK_VERSION_PATCH\t0\n")
    files = {
        "spdk_nvme": pc("spdk_nvme", f"-L{lib} -lspdk_nvme", "spdk_sock spdk_log"),
        "spdk_sock": pc("spdk_sock", f"-L{lib} -lspdk_sock", "spdk_sock_modules"),
        "spdk_sock_modules": pc("spdk_sock_modules", f"-L{lib} -lspdk_sock_posix"),
        "spdk_log": pc("spdk_log", f"-L{lib} -lspdk_log"),
        "spdk_env_dpdk": pc("spdk_env_dpdk", f"-L{lib} -lspdk_env_dpdk", "spdk_dpdklibs"),
        "spdk_dpdklibs": pc("spdk_dpdklibs", f"-L{lib} -lrte_eal -lrte_mempool", version="1.0"),
        "spdk_syslibs": pc("spdk_syslibs", "", private="-pthread -lrt -luuid -lssl -lcrypto -laio "
                           "-lbsd", version="1.0"),
    }
    for name, text in files.items():
        (lib / "pkgconfig" / f"{name}.pc").write_text(text.replace("{inc}", str(inc)))
    return lib


def configure(tmp_path: Path, pkgconfig: str, mode: str) -> subprocess.CompletedProcess[str]:
    import pybind11

    env = dict(os.environ, PKG_CONFIG_PATH=pkgconfig, PKG_CONFIG_LIBDIR=pkgconfig)
    return subprocess.run(
        [CMAKE, "-S", str(REPO), "-B", str(tmp_path / "build"), f"-DKVPOOL_WITH_SPDK={mode}",
         f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
         "-DKVPOOL_BUILD_TESTS=ON"],
        env=env, capture_output=True, text=True, timeout=300,
    )


def link_line(build: Path, target: str) -> list[str]:
    return (build / "CMakeFiles" / f"{target}.dir" / "link.txt").read_text().split()


@pytest.mark.skipif(CMAKE is None or shutil.which("pkg-config") is None,
                    reason="cmake or pkg-config not installed")
def test_spdk_link_line_follows_spdks_pkgconfig_doc(tmp_path: Path) -> None:
    lib = fake_spdk(tmp_path / "spdk")
    # liburing/libnuma must stay findable: keep the system pkg-config dirs after the fake one.
    sysdirs = subprocess.run(["pkg-config", "--variable", "pc_path", "pkg-config"],
                             capture_output=True, text=True).stdout.strip()
    out = configure(tmp_path, f"{lib / 'pkgconfig'}{os.pathsep}{sysdirs}", "ON")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"SPDK (KVPOOL_WITH_SPDK=ON): v25.09.0 ({lib})" in out.stdout
    assert "backends compiled: posix uring spdk" in out.stdout
    for target in ("_kvio", "kvio_unit_tests"):
        args = link_line(tmp_path / "build", target)
        no, yes = args.index("-Wl,--no-as-needed"), args.index("-Wl,--as-needed")
        spdk_libs = [a for a in args if a.startswith(("-lspdk_", "-lrte_"))]
        # Every SPDK/DPDK library, including the one only a constructor uses, sits in the group.
        assert {"-lspdk_nvme", "-lspdk_sock", "-lspdk_sock_posix", "-lspdk_env_dpdk",
                "-lspdk_log", "-lrte_eal"} <= set(spdk_libs), args
        assert all(no < args.index(a) < yes for a in spdk_libs), args
        # The system libraries from Libs.private (--static), after the group.
        for sys_lib in ("-lssl", "-lcrypto", "-luuid", "-laio", "-lbsd", "-lrt"):
            assert sys_lib in args and args.index(sys_lib) > yes, (sys_lib, args)
        assert f"-Wl,-rpath,{lib}" in args  # imports without LD_LIBRARY_PATH


@pytest.mark.skipif(CMAKE is None or shutil.which("pkg-config") is None,
                    reason="cmake or pkg-config not installed")
def test_spdk_on_without_spdk_fails_clearly(tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    sysdirs = subprocess.run(["pkg-config", "--variable", "pc_path", "pkg-config"],
                             capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, PKG_CONFIG_PATH="", PKG_CONFIG_LIBDIR=sysdirs)
    if subprocess.run(["pkg-config", "--exists", "spdk_nvme"], env=env).returncode == 0:
        pytest.skip("SPDK is installed system-wide here")
    out = configure(tmp_path, f"{empty}{os.pathsep}{sysdirs}", "ON")
    assert out.returncode != 0
    assert "KVPOOL_WITH_SPDK=ON but pkg-config cannot find spdk_nvme" in out.stdout + out.stderr
