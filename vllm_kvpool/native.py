"""The C++ I/O engine ``vllm_kvpool._kvio``, imported on first use (keeps imports light)."""

from __future__ import annotations

from typing import Any


def kvio() -> Any:
    """The ``_kvio`` module, or an ImportError that says how to build it."""
    try:
        from vllm_kvpool import _kvio
    except ImportError as exc:  # pragma: no cover - depends on the build
        from vllm_kvpool.environment import CORE_FIX

        raise ImportError(
            f"vllm_kvpool._kvio (the C++ I/O engine) cannot be imported ({exc}): {CORE_FIX}; "
            "in a checkout: make bootstrap"
        ) from exc
    return _kvio
