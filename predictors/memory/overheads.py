"""CUDA-side memory that a CPU trace cannot see, modelled explicitly.

* cuBLAS workspace: PyTorch allocates one workspace per (cuBLAS handle, stream) through the
  caching allocator, on the first GEMM of a thread. The forward runs on the Python thread and
  the backward on the autograd engine's device thread, which has its own handle, so a training
  step holds two workspaces. Size from the default ``CUBLAS_WORKSPACE_CONFIG``
  (``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB before Hopper, ``:4096:8:16:8`` = 32.125 MiB on
  sm90+); these count in ``max_memory_allocated`` and ``max_memory_reserved``.
* CUDA context + the loaded libraries' kernels: not seen by the caching allocator, but taken
  from the card's capacity (``nvidia-smi`` counts it). Sizes in :data:`CONTEXTS`, each with
  the measurement it comes from.
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
    cudnn_workspaces: bool = False  # convolutions allocate cuDNN workspaces (tracker)
    cudnn_context_bytes: int = 0  # cuDNN's kernels, loaded by a step with convolutions

    @property
    def workspace_total(self) -> int:
        return self.cublas_workspace_bytes * self.cublas_workspaces


@dataclass(frozen=True)
class ContextSize:
    """Device memory a PyTorch process holds outside the caching allocator once CUDA, cuBLAS
    and (when used) cuDNN are initialised, with the measurement it comes from."""

    bytes: int
    basis: str
    cudnn_bytes: int = 0  # added when the step runs convolutions (cuDNN loaded)
    cudnn_basis: str = ""


CONTEXTS: dict[str, ContextSize] = {
    # GPUMemNet (github.com/itu-rad/GPUMemNet, CC BY 4.0), A100-40GB: its smallest MLP (310
    # parameters + activation elements, i.e. an initialised process) peaks at 1451 MiB in
    # nvidia-smi; the traced step reserves 22 MiB (two cuBLAS workspaces + small-pool
    # segments): 1429 MiB outside the allocator. Eager module loading (CUDA < 11.7 or
    # CUDA_MODULE_LOADING=EAGER) loads every kernel image of libtorch_cuda, cuBLAS and cuDNN;
    # lazy loading (PyTorch's default since 1.13, pytorch/pytorch#86509: 287 MB vs 667 MB for
    # the bare context) loads only the kernels used, so on such stacks this is conservative.
    # cuDNN: a step with convolutions loads its kernels too. GPUMemNet's CNN development rows
    # (same A100-40GB and stack, predictors/data/gpumemnet_cnn_dev.csv): its smallest conv net
    # (row 600: uniform, depth 2, 44 filters, 3x16x16, batch 22) peaks at 1747 MiB where the
    # traced step plus the context above is 1457 MiB: 290 MiB (the next five smallest read
    # 236-292). A net with no convolution (row 680: pooling + one Linear) reads 1467 MiB,
    # exactly the traced step plus the context, so the extra is cuDNN's.
    "ampere": ContextSize(1429 * MiB, "GPUMemNet A100-40GB smallest MLP: 1451 - 22 MiB",
                          290 * MiB, "GPUMemNet A100-40GB smallest CNN (row 600): 1747 - 1457 "
                          "MiB"),
    # Measured on an H200 (gpu_check, 2026-12-04, driver 580.159.04, CUDA 13.0, torch 2.11,
    # commit 05df9b1; predictors/data/gpu/h200-2026-12-04/): NVML used at the peak minus
    # max_memory_reserved of the first training step in a fresh process (ResNet-18, cuDNN
    # loaded by it) is 1382 MiB; later steps of the same process read 1384-1402 MiB as lazily
    # loaded kernels accumulate (at most 1402 over its 92 steps: the figure kept, so the OOM
    # verdict stays on the safe side). The bare context with cuBLAS is 682 MiB (device.csv:
    # cuda_context_bytes); a training step loads far more.
    # That run loaded cuDNN with its first step (a conv net), so this figure includes cuDNN's
    # kernels; a step without convolutions holds less (not measured on Hopper: conservative).
    "hopper": ContextSize(1402 * MiB, "H200 gpu_check 2026-12-04: NVML used - "
                          "max_memory_reserved over 92 training steps, max (first step 1382; "
                          "cuDNN loaded)"),
}


PRE_HOPPER = CudaOverheads("pre-hopper", 2 * 4 * MiB + 8 * 16 * KiB, 2,
                           CONTEXTS["ampere"].bytes)
HOPPER = CudaOverheads("hopper", 8 * 4 * MiB + 8 * 16 * KiB, 2, CONTEXTS["hopper"].bytes)
NONE = CudaOverheads("none", 0, 0, 0)

# Card capacity (what nvidia-smi reports as total) for the OOM verdict.
CARDS: dict[str, tuple[int, CudaOverheads]] = {
    "24": (24 * GiB, PRE_HOPPER),  # RTX 4090 / A10-class
    "40": (40 * GiB, PRE_HOPPER),  # A100-40GB
    "80": (80 * GiB, HOPPER),  # H100-80GB
    "141": (141 * GiB, HOPPER),  # H200
}
