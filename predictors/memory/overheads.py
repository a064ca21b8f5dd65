"""CUDA-side memory that a CPU trace cannot see, modelled explicitly.

* cuBLAS workspace: PyTorch allocates one workspace per (cuBLAS handle, stream) through the
  caching allocator, on the first GEMM of a thread. The forward runs on the Python thread and
  the backward on the autograd engine's device thread, which has its own handle, so a training
  step holds two workspaces. Size from the default ``CUBLAS_WORKSPACE_CONFIG``
  (``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB before Hopper, ``:4096:8:16:8`` = 32.125 MiB on
  sm90+); these count in ``max_memory_allocated`` and ``max_memory_reserved``.
* CUDA context + loaded kernels (lazy module loading): not seen by the caching allocator, but
  taken from the card's capacity. It is added to the reserved peak for the OOM verdict only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocator import GiB, KiB, MiB


@dataclass(frozen=True)
class CudaOverheads:
    name: str
    cublas_workspace_bytes: int  # one per (handle, stream)
    cublas_workspaces: int  # forward thread + autograd device thread
    context_bytes: int  # CUDA context, outside the caching allocator

    @property
    def workspace_total(self) -> int:
        return self.cublas_workspace_bytes * self.cublas_workspaces


PRE_HOPPER = CudaOverheads("pre-hopper", 2 * 4 * MiB + 8 * 16 * KiB, 2, 400 * MiB)
HOPPER = CudaOverheads("hopper", 8 * 4 * MiB + 8 * 16 * KiB, 2, 520 * MiB)
NONE = CudaOverheads("none", 0, 0, 0)

# Card capacity (what nvidia-smi reports as total) for the OOM verdict.
CARDS: dict[str, tuple[int, CudaOverheads]] = {
    "24": (24 * GiB, PRE_HOPPER),  # RTX 4090 / A10-class
    "40": (40 * GiB, PRE_HOPPER),  # A100-40GB
    "80": (80 * GiB, HOPPER),  # H100-80GB
    "141": (141 * GiB, HOPPER),  # H200
}
