"""The C++ I/O engine ``vllm_kvpool._kvio``, imported on first use (keeps imports light)."""

from __future__ import annotations

from typing import Any


def kvio() -> Any:
    """The ``_kvio`` module, or an ImportError that says how to build it."""
    try:
        from vllm_kvpool import _kvio
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise ImportError(
            "vllm_kvpool._kvio (the C++ I/O engine) is not built: run "
            "`pip install --no-build-isolation -e .` in the repository"
        ) from exc
    return _kvio
