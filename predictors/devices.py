"""Device descriptions: peak FLOP/s per dtype, memory and interconnect bandwidth.

GPUs come from a table of datasheet numbers (dense tensor-core rates), looked up by name or
detected through NVML (``nvidia-ml-py``); without a GPU or NVML the local CPU is described from
``/proc/cpuinfo`` flags plus a short calibration run (GEMM rate per dtype, streaming bandwidth
per dtype, per-op dispatch overhead), because CPU rates depend on ISA extensions (AMX,
AVX-512 BF16/FP16) far more than on clock speed.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

CPU_THREADS = 1  # `predict collect` measures single-threaded steps; CPU predictions match that
SMALL_GEMM_N, LARGE_GEMM_N = 96, 384  # calibration GEMM sizes (n x n x n)
SMALL_GEMM_FLOPS, LARGE_GEMM_FLOPS = 2.0 * SMALL_GEMM_N**3, 2.0 * LARGE_GEMM_N**3
# Without AMX a CPU core's 16-bit GEMM cannot beat twice its fp32 rate: AVX512_BF16's
# VDPBF16PS and AVX512_FP16's VFMADDPH do two products per 32-bit lane per instruction (Intel
# Intrinsics Guide: _mm512_dpbf16_ps, _mm512_fmadd_ph), on the same FMA ports as VFMADDPS;
# emulated paths convert to fp32 first and are slower still. A calibration above that ceiling
# is a measurement artefact (the shipped profile's bf16 384^3 GEMM read 4.3x its fp32 one).
CPU_HALF_VS_FP32_CEILING = 2.0


class UnknownDeviceError(ValueError):
    """A device name that is neither in :data:`DEVICES` nor ``cpu``/``local``."""


class UnsupportedPrecisionError(ValueError):
    """A precision the device cannot run (fp8 without fp8 tensor cores)."""


@dataclass(frozen=True)
class Device:
    name: str
    family: str  # model family key for the learned correction: a100, h100, cpu, ...
    kind: str  # "gpu" | "cpu"
    peak_flops: dict[str, float]  # matmul FLOP/s per dtype key (tensor cores where present)
    mem_bw: float  # bytes/s
    intra_bw: float  # bytes/s per device inside a node (NVLink / shared memory)
    inter_bw: float  # bytes/s per device across nodes (InfiniBand / TCP)
    memory_bytes: float
    devices_per_node: int = 8
    launch_overhead: float = 5e-6  # seconds per kernel (GPU launch, CPU dispatch)
    comm_latency: float = 10e-6  # seconds per collective step
    # fixed cost of a tensor-core GEMM beyond FLOPs / rate (prologue, epilogue, the last
    # partial wave): small GEMMs run far below peak, large ones approach it
    gemm_latency: float = 0.0
    vec_bw: dict[str, float] = field(default_factory=dict)  # elementwise bytes/s per dtype key
    # measured GEMM rate at SMALL_GEMM_FLOPS per dtype key (CPUs: small GEMMs run far below
    # peak); rates between the two sizes are interpolated in log space
    small_gemm: dict[str, float] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    # share of peak per "<op_class>:<dtype key>" (and torch.compile's "compiled" factor),
    # fitted per device family on development rows (predictors.time.efficiency); empty: the
    # roofline defaults of predictors.time.analytical
    efficiency: dict[str, float] = field(default_factory=dict)

    @property
    def supports_fp8(self) -> bool:
        return self.peak_flops.get("fp8", 0.0) > 0

    def matmul_rate(self, dtype_key: str, flops: float | None = None) -> float:
        rate = self.peak_flops.get(dtype_key, 0.0)
        if rate <= 0:
            return self.peak_flops["fp32"]
        small = self.small_gemm.get(dtype_key)
        if self._half_without_amx(dtype_key):
            rate = min(rate, CPU_HALF_VS_FP32_CEILING * self.peak_flops["fp32"])
            if small:
                small = min(small, CPU_HALF_VS_FP32_CEILING * self.small_gemm.get("fp32", small))
        if not small or flops is None:
            return rate
        # A larger GEMM is never slower per FLOP on real hardware; a measured large-GEMM rate
        # below the small one is an emulated dtype (fp16 on CPUs without AVX512-FP16/AMX-FP16
        # converts per element and stays flat) or a contention hit during calibration.
        rate = max(rate, small)
        if flops >= LARGE_GEMM_FLOPS:
            return rate
        if flops <= SMALL_GEMM_FLOPS:
            return small
        w = math.log(flops / SMALL_GEMM_FLOPS) / math.log(LARGE_GEMM_FLOPS / SMALL_GEMM_FLOPS)
        return math.exp((1 - w) * math.log(small) + w * math.log(rate))

    def _half_without_amx(self, dtype_key: str) -> bool:
        return self.kind == "cpu" and dtype_key in ("bf16", "fp16") and (
            f"amx_{dtype_key}" not in self.flags)

    def vector_bw(self, dtype_key: str) -> float:
        return self.vec_bw.get(dtype_key, self.mem_bw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Device:
        return cls(**{**d, "flags": tuple(d.get("flags", ()))})


# Effective host-side cost per kernel of eager PyTorch/Megatron training (launch + Python
# dispatch + stream sync points), and per collective step. Defaults for devices without a
# correction; a trained correction carries the values fitted on its own training rows
# (predictors.time.calibrate, meta["device_constants"]), and held-out evaluations refit per fold.
GPU_KERNEL_OVERHEAD = 40e-6
GPU_COMM_LATENCY = 20e-6


def _gpu(name, family, fp32, tf32, half, fp8, mem_bw, nvlink, ib, mem_gb, bf16=None,
         mxfp8=0.0) -> Device:  # fmt: skip
    peaks = {"fp32": fp32, "tf32": tf32, "bf16": half if bf16 is None else bf16, "fp16": half,
             "fp8": fp8, "mxfp8": mxfp8}  # fmt: skip
    return Device(
        name,
        family,
        "gpu",
        peaks,
        mem_bw,
        nvlink,
        ib,
        mem_gb * 2**30,
        launch_overhead=GPU_KERNEL_OVERHEAD,
        comm_latency=GPU_COMM_LATENCY,
    )


T = 1e12
G = 1e9
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _gpu("a100-40gb", "a100", 19.5 * T, 156 * T, 312 * T, 0, 1555 * G, 300 * G, 25 * G, 40),
        _gpu("a100-80gb", "a100", 19.5 * T, 156 * T, 312 * T, 0, 2039 * G, 300 * G, 25 * G, 80),
        _gpu(
            "h100-80gb", "h100", 67 * T, 495 * T, 989 * T, 1979 * T, 3350 * G, 450 * G, 50 * G, 80
        ),  # fmt: skip
        # Meta's Grand Teton H100 (torchtitan's published runs): 96 GB HBM2e at 2.4 TB/s, 500 W;
        # its peak lies between SXM and NVL and is not published: the SXM figures stand in
        _gpu("h100-96gb", "h100", 67 * T, 495 * T, 989 * T, 1979 * T, 2400 * G, 450 * G, 50 * G, 96),
        # NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/, SXM): FP32 67
        # TFLOPS; TF32 989, BF16/FP16 1,979, FP8 3,958 TFLOPS with sparsity (dense: half);
        # 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional. Rechecked in #44: the kit's
        # tf32 rows' under-prediction is its fp32 attention's 3xTF32 kernel, not these peaks
        _gpu("h200", "h100", 67 * T, 495 * T, 989 * T, 1979 * T, 4800 * G, 450 * G, 50 * G, 141),
        # HGX B200 datasheet (dense = half the sparse figures): MXFP8 block scaling runs on
        # Blackwell tensor cores at the fp8 rate; NVLink 5 1.8 TB/s bidirectional per GPU
        _gpu("b200", "b200", 75 * T, 1100 * T, 2250 * T, 4500 * T, 8000 * G, 900 * G, 50 * G, 180,
             mxfp8=4500 * T),  # fmt: skip
        _gpu("l40s", "l40s", 91.6 * T, 183 * T, 362 * T, 733 * T, 864 * G, 32 * G, 25 * G, 48),
        # V100 has no bf16 tensor cores: bf16 matmuls fall back to CUDA-core fp32 rates.
        _gpu(
            "v100", "v100", 15.7 * T, 0, 125 * T, 0, 900 * G, 150 * G, 12.5 * G, 32, bf16=15.7 * T
        ),  # fmt: skip
    )
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200", "v100-32gb": "v100"}


def get_device(name: str | Device) -> Device:
    """Look a device up by name (``a100-80gb``, ``h100``, ``cpu``/``local`` = this machine)."""
    if isinstance(name, Device):
        return name
    key = name.strip().lower()
    if key in ("cpu", "local"):
        return local_device() if key == "local" else cpu_device(CPU_THREADS)
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise UnknownDeviceError(
            f"device={name!r} is unknown; choose one of {', '.join(DEVICES)}, cpu, local"
        )
    return DEVICES[key]


def require_precision_support(device: Device, precision) -> None:
    """The precision's ``requires_rate`` column must be non-zero on ``device``."""
    col = precision.requires_rate
    if col is not None and device.peak_flops.get(col, 0.0) <= 0:
        have = [n for n, d in DEVICES.items() if d.peak_flops.get(col, 0.0) > 0]
        raise UnsupportedPrecisionError(
            f"precision={precision.name!r} needs the device's {col!r} rate (requires_rate); "
            f"device={device.name!r} has none ({precision.name} runs on {', '.join(have) or 'no table device'})"
        )


# ---------------------------------------------------------------------------------------------
# Local detection


def nvml_device() -> Device | None:
    """The first local GPU as a table device (with NVML's memory size), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver / no library: a CPU-only machine
        return None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory = float(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    return match_gpu_name(name, memory, count)


def match_gpu_name(name: str, memory_bytes: float, count: int = 8) -> Device | None:
    n = name.upper()
    gb = memory_bytes / 2**30
    for token, key in (("B200", "b200"), ("H200", "h200"), ("H100", "h100-80gb"), ("L40S", "l40s"),
                       ("V100", "v100"), ("A100", "a100-80gb" if gb > 50 else "a100-40gb")):  # fmt: skip
        if token in n:
            base = DEVICES[key]
            return Device(**{**base.__dict__, "memory_bytes": memory_bytes,
                             "devices_per_node": count})  # fmt: skip
    return None


def local_device() -> Device:
    return nvml_device() or cpu_device(CPU_THREADS)


def cpu_flags() -> tuple[str, ...]:
    wanted = {"amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f",
              "avx2", "fma"}  # fmt: skip
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return tuple(sorted(wanted & set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return ()


def _best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _autograd_kernel_overhead(chain: int = 64) -> float:
    """Seconds per kernel of a training step made of tiny ops: forward, autograd backward and
    the Python around them, i.e. what every kernel costs on a CPU before it does any work."""
    x = torch.randn(8, requires_grad=True)

    def step():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return _best_time(step, 10) / (2 * chain + 3)


@functools.lru_cache(maxsize=4)
def cpu_device(threads: int | None = None) -> Device:
    """Describe this CPU by calibration (≈1 s). Rates are minima-of-repeats, robust to the
    contention episodes of shared VMs. ``threads`` defaults to torch's current setting."""
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        peaks, small = {}, {}
        for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                           ("fp16", torch.float16)):  # fmt: skip
            for n, table in ((LARGE_GEMM_N, peaks), (SMALL_GEMM_N, small)):
                a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
                table[key] = 2 * n**3 / _best_time(lambda a=a, b=b: a @ b, 10)
        peaks["tf32"], small["tf32"] = peaks["fp32"], small["fp32"]
        peaks["fp8"] = 0.0  # CPU _scaled_mm is an emulation, not an fp8 rate
        vec = {}
        for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                           ("fp16", torch.float16)):  # fmt: skip
            x = torch.randn(1 << 21, dtype=dtype)
            vec[key] = 3 * x.numel() * x.element_size() / _best_time(lambda x=x: x + x, 10)
        overhead = _autograd_kernel_overhead()
        name = "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), name)
        except OSError:
            pass
        return Device(
            name=f"cpu:{name}:{torch.get_num_threads()}t",
            family="cpu",
            kind="cpu",
            peak_flops=peaks,
            mem_bw=vec["fp32"],
            intra_bw=vec["fp32"] / 8,  # gloo over loopback: copies through the kernel
            inter_bw=1.25e9,
            memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
            devices_per_node=os.cpu_count() or 1,
            launch_overhead=overhead,
            comm_latency=50e-6,
            vec_bw=vec,
            small_gemm=small,
            flags=cpu_flags(),
        )
    finally:
        torch.set_num_threads(prev)
