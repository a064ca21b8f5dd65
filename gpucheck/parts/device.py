"""(5) NVML device detection into the predictors' ``Device`` vs the device table entry, plus
two measured ceilings (a bf16 GEMM and a device-to-device copy) next to the table's peaks."""

from __future__ import annotations

from typing import Any

from gpucheck import adapters
from gpucheck.common import NO_GPU, Budget, PartContext, RowWriter, nvml_info, nvml_used_bytes

FILE = "device.csv"
# Dense tensor-core FLOP per clock per SM by compute capability major (Hopper: H100/H200).
DENSE_FLOP_PER_CLK_SM = {9: {"bf16": 4096, "fp16": 4096, "tf32": 2048, "fp8": 8192}}
TOLERANCE = {"memory_bytes": 0.02, "mem_bw": 0.10, "peak": 0.10}


def _rel_match(a: float | None, b: float | None, tol: float) -> bool | None:
    if not a or not b:
        return None
    return abs(a - b) / b <= tol


def compare(info: dict, props: dict | None, detected: Any | None, table_key: str | None,
            table: Any | None) -> list[dict]:
    """Rows comparing NVML (``info``), torch's device properties (``props``: ``sm_count``,
    ``major``, ``minor``), the detected Device and the table entry. Pure: tested without a GPU."""
    rows = [{
        "field": "name", "nvml": info["name"], "detected": detected and detected.name,
        "table": table and table.name, "table_key": table_key,
        "match": detected is not None and table is not None and detected.name == table.name,
        "note": "" if table is not None else "no table entry matches this name",
    }]
    mem_table = table.memory_bytes if table else None
    rows.append({"field": "memory_bytes", "nvml": info["memory_total"],
                 "detected": detected and int(detected.memory_bytes),
                 "table": mem_table and int(mem_table), "table_key": table_key,
                 "match": _rel_match(info["memory_total"], mem_table, TOLERANCE["memory_bytes"]),
                 "note": "detection keeps NVML's size; the table holds the datasheet GiB"})
    rows.append({"field": "devices_per_node", "nvml": info["count"],
                 "detected": detected and detected.devices_per_node,
                 "table": table and table.devices_per_node, "table_key": table_key,
                 "match": detected is not None and detected.devices_per_node == info["count"],
                 "note": "detected must equal NVML's count; the table assumes 8"})
    clock, width = info.get("max_mem_clock_mhz"), info.get("mem_bus_width_bits")
    bw = 2 * clock * 1e6 * width / 8 if clock and width else None  # double data rate
    rows.append({"field": "mem_bw", "nvml": bw, "detected": detected and detected.mem_bw,
                 "table": table and table.mem_bw, "table_key": table_key,
                 "match": _rel_match(bw, table and table.mem_bw, TOLERANCE["mem_bw"]),
                 "note": f"NVML: 2 x max memory clock {clock} MHz x bus {width} bit / 8"})
    rows.append({"field": "max_sm_clock_mhz", "nvml": info.get("max_sm_clock_mhz"),
                 "table_key": table_key, "note": "no clock in Device: it holds peak FLOP/s"})
    per_clk = DENSE_FLOP_PER_CLK_SM.get(props["major"]) if props else None
    sm_clock = info.get("max_sm_clock_mhz")
    for dtype in ("tf32", "bf16", "fp16", "fp8"):
        implied = (props["sm_count"] * sm_clock * 1e6 * per_clk[dtype]
                   if per_clk and sm_clock else None)
        peak = table.peak_flops.get(dtype) if table else None
        rows.append({"field": f"peak_flops_{dtype}", "nvml": implied,
                     "detected": detected and detected.peak_flops.get(dtype), "table": peak,
                     "table_key": table_key,
                     "match": _rel_match(implied, peak, TOLERANCE["peak"]),
                     "note": ("SMs x max SM clock x dense FLOP/clk/SM of compute capability "
                              f"{props['major']}.{props['minor']}" if per_clk else
                              "no FLOP/clk/SM known for this architecture")
                     if props else "no torch device properties"})
    if props:
        fp8_hw = (props["major"], props["minor"]) >= (8, 9)
        rows.append({"field": "supports_fp8", "nvml": fp8_hw,
                     "detected": detected and detected.supports_fp8,
                     "table": table and table.supports_fp8, "table_key": table_key,
                     "match": detected is not None and detected.supports_fp8 == fp8_hw,
                     "note": "compute capability >= 8.9 has fp8 tensor cores"})
    for r in rows:
        r["status"] = "ok"
    return rows


def _measured(table: Any | None) -> list[dict]:
    """A bf16 GEMM rate and a device-to-device copy rate (the ceilings KINDS.md recorded)."""
    import torch

    rows = []
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    rate = 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3)
    rows.append({"field": "measured_bf16_gemm_flops", "nvml": rate,
                 "table": table and table.peak_flops["bf16"],
                 "note": "8192^3 bf16 matmul, random data, mean of 10 after 3 warm-ups"})
    del a, b
    x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start.record()
    for _ in range(5):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bw = 5 * 2 * x.numel() / (start.elapsed_time(end) / 1e3)
    rows.append({"field": "measured_d2d_copy_bw", "nvml": bw, "table": table and table.mem_bw,
                 "note": "2 GiB device-to-device copy, bytes read + written, mean of 5"})
    for r in rows:
        r["status"] = "ok"
        r["match"] = None
    return rows


def _cuda_context_bytes() -> int | None:
    """Device memory a fresh process's CUDA context takes (with cuBLAS loaded by a matmul):
    what the memory predictor adds outside the caching allocator. Call before any CUDA use."""
    import torch

    before = nvml_used_bytes()
    torch.cuda.init()
    x = torch.ones(64, 64, device="cuda")
    (x @ x).sum().item()
    torch.cuda.synchronize()
    after = nvml_used_bytes()
    allocator = torch.cuda.memory_reserved()
    return None if before is None or after is None else after - before - allocator


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    info = nvml_info() if ctx.device == "cuda" else None
    if info is None:
        why = NO_GPU if ctx.device != "cuda" else "NVML not available on this GPU machine"
        detected = adapters.detect_device()  # the CPU path of the same detection: must be None
        w.write(field="nvml", detected=detected and detected.name, status="skipped",
                note=f"{why} (predictors' nvml_device() returned {detected!r})")
        return {"_status": "skipped", "reason": why}
    import torch

    context = _cuda_context_bytes()
    p = torch.cuda.get_device_properties(0)
    props = {"sm_count": p.multi_processor_count, "major": p.major, "minor": p.minor}
    detected = adapters.detect_device()
    key, table = adapters.table_device(info["name"], info["memory_total"])
    rows = compare(info, props, detected, key, table)
    rows.append({"field": "cuda_context_bytes", "nvml": context, "status": "ok",
                 "note": "NVML used after torch.cuda.init() + one torch.mm, minus before and minus "
                         "the caching allocator's reserved bytes (this "
                         f"process; torch {torch.__version__}, CUDA {torch.version.cuda}, "
                         f"driver {info['driver']})"})
    budget.check("the measured ceilings")
    try:
        rows += _measured(table)
    except Exception as exc:  # noqa: BLE001 - the comparison rows still stand
        rows.append({"field": "measured", "status": "error", "note": repr(exc)[:300]})
    for r in rows:
        w.write(**r)
    mismatches = [r["field"] for r in rows if r.get("match") is False]
    return {"gpu": info["name"], "table_key": key, "mismatches": mismatches,
            "cuda_context_bytes": context,
            "nvml": {k: v for k, v in info.items() if k != "memory_used"}}
