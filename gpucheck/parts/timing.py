"""(3) Time ground truth: per-iteration time of transformer configs across precisions
(fp32, tf32, bf16 autocast, bf16 pure, fp16 autocast + scaler, bf16 with fp32 masters, fp8 GEMMs
through ``torch._scaled_mm`` as the predictor emulates them), with warm-up and repeats, the time
predictor's prediction next to each row.

Rows carry ``predict collect``'s columns (``seconds`` is the 20 % quantile of the repeats, as
there), so a GPU file folds into the predictor's training data unchanged. Timing uses CUDA events
around each step (host wall clock on the CPU dry run); a fixed bf16 GEMM canary before each
point records the device's current speed (clock throttling shows up in ``canary_ratio``).
"""

from __future__ import annotations

import random
import statistics
import time

from gpucheck import adapters
from gpucheck.common import Budget, BudgetExceeded, PartContext, RowWriter, error_text
from gpucheck.predictions import Predictions
from gpucheck.steps import RealStep
from predictors.devices import get_device
from predictors.spec.precision import PRECISIONS

FILE = "time.csv"
# (name, family, layers, hidden, heads, seq, micro-batch)
GPU_CONFIGS = (
    ("gpt-1b-l4", "gpt", 4, 2048, 16, 2048, 4),
    ("gpt-350m-l8", "gpt", 8, 1024, 16, 1024, 8),
    ("llama-h2048-l4", "llama", 4, 2048, 16, 2048, 2),
    ("gpt-h4096-l2", "gpt", 2, 4096, 32, 2048, 2),
)
DRY_CONFIGS = (("gpt-tiny", "gpt", 2, 64, 4, 32, 2),)
VOCAB = {"gpu": 32000, "tiny": 512}
WARMUP, REPEATS = 3, 10  # GPU
DRY_WARMUP, DRY_REPEATS = 1, 2


def _timer(device: str):
    """(start, stop) -> seconds of the work between them on ``device``."""
    import torch

    if device == "cuda":
        def measure(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3, time.perf_counter() - t0
        return measure

    def measure_cpu(fn):
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        return t, t
    return measure_cpu


def canary_ms(device: str) -> float:
    import torch

    n = 4096 if device == "cuda" else 128
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    measure = _timer(device)
    measure(lambda: a @ a)
    return 1e3 * min(measure(lambda: a @ a)[0] for _ in range(5))


def _flops(spec, micro_batch: int) -> float:
    """6 x parameters x tokens + attention (the usual training-FLOP estimate, for a TFLOP/s
    column only; the predictor's own work model is not used here)."""
    h, layers, s = spec.hidden_size, spec.num_layers, spec.seq_length
    params = 12 * layers * h * h + spec.vocab_size * h
    return 6.0 * params * micro_batch * s + 12.0 * layers * micro_batch * s * s * h


def measure_point(name, family, layers, hidden, heads, seq, mb, precision, device,
                  tiny) -> dict:
    import torch

    spec = adapters.transformer_spec(family, layers, hidden, heads, seq,
                                     VOCAB["tiny" if tiny else "gpu"])
    torch.manual_seed(0)
    with torch.device(device):
        model = adapters.build_time_model(spec)
    inputs, target = adapters.time_batch(spec, mb)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    target = target.to(device)
    step = RealStep(model, precision, device, "fused")
    measure = _timer(device)
    warmup, repeats = (DRY_WARMUP, DRY_REPEATS) if tiny else (WARMUP, REPEATS)
    for _ in range(warmup):
        step(inputs, None, target)
    if device == "cuda":
        torch.cuda.synchronize()
    times, walls = [], []
    for _ in range(repeats):
        t, wall = measure(lambda: step(inputs, None, target))
        times.append(t)
        walls.append(wall)
    s = sorted(times)
    low = s[min(len(s) - 1, int(0.2 * len(s)))]
    med = statistics.median(times)
    kind, spec_json = adapters.spec_row(spec)
    return {"model": name, "family": family, "spec_kind": kind, "spec_json": spec_json,
            "seq": seq, "precision": precision, "micro_batch": mb, "dp": 1, "seconds": low,
            "median_s": med, "min_s": s[0], "wall_s": sorted(walls)[len(walls) // 5],
            "repeats": len(times), "threads": torch.get_num_threads(),
            "timestamp": time.time(), "spread_pct": 100.0 * (s[-1] - s[0]) / med,
            "tflops": _flops(spec, mb) / low / 1e12, "_spec": spec}


def predict_row(family, layers, hidden, heads, seq, mb, precision, device, tiny) -> dict:
    """The time predictor's answer for one grid point (a worker process on a GPU run)."""
    spec = adapters.transformer_spec(family, layers, hidden, heads, seq,
                                     VOCAB["tiny" if tiny else "gpu"])
    try:
        pred = adapters.predict_time(spec, mb, precision, device)
    except Exception as exc:  # noqa: BLE001 - the measurement stands without it
        return {"pred_note": f"prediction failed: {error_text(exc, 200)}"}
    return {"pred_seconds": pred["seconds"], "pred_analytical_s": pred["analytical_s"],
            "pred_device": pred["device"],
            "pred_note": "calibrated" if pred["calibrated"] else "analytical only"}


def _merge(row: dict, pred: dict) -> dict:
    row = {**row, **pred}
    if row.get("pred_seconds") and row.get("seconds"):
        row["pred_error_pct"] = 100.0 * (row["pred_seconds"] - row["seconds"]) / row["seconds"]
    return row


def dry_precisions() -> tuple[str, ...]:
    """The dry run's precisions, read from the Precision table: the first entry with autocast
    and a GradScaler, and the first with an fp8 recipe (torch._scaled_mm has a CPU kernel):
    the two paths a CPU exercises that plain fp32 does not."""
    picks = (lambda p: p.autocast and p.grad_scaler, lambda p: p.fp8)
    return tuple(next(n for n, p in PRECISIONS.items() if pick(p)) for pick in picks)


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    tiny = ctx.dry_run
    configs = DRY_CONFIGS if tiny else GPU_CONFIGS
    # every entry of the one Precision table the device can run
    rates = get_device(adapters.time_device(ctx.device)).peak_flops
    precisions = dry_precisions() if tiny else tuple(
        n for n, p in PRECISIONS.items() if p.requires_rate is None or rates.get(p.requires_rate))
    points = [(c, p) for c in configs for p in precisions]
    random.Random(0).shuffle(points)
    device = adapters.time_device(ctx.device)
    print(f"time predictor device: {device}", flush=True)
    abs_errors: list[float] = []

    def merge(row: dict, pred: dict) -> dict:
        row = _merge(row, pred)
        if "pred_error_pct" in row:
            abs_errors.append(abs(row["pred_error_pct"]))
        return row

    preds = Predictions(predict_row, merge, w, parallel=not tiny)
    for cfg, prec in points:
        preds.submit((cfg, prec), *cfg[1:], prec, device, tiny)
    best_canary = canary_ms(ctx.device)
    errors, cut = 0, None
    try:
        for i, (cfg, prec) in enumerate(points):
            if budget.expired(reserve=5.0 if tiny else 0.2 * budget.seconds):
                cut = f"time grid cut at {i}/{len(points)} points by the budget"
                break
            canary = canary_ms(ctx.device)
            best_canary = min(best_canary, canary)
            try:
                row = measure_point(*cfg, prec, ctx.device, tiny)
            except Exception as exc:  # noqa: BLE001 - e.g. an OOM or an unsupported dtype
                errors += 1
                w.write(model=cfg[0], family=cfg[1], precision=prec, status="error",
                        note=error_text(exc))
                continue
            row.pop("_spec")
            row.update(canary_ms=canary, canary_ratio=canary / best_canary, status="ok")
            if tiny:
                row["note"] = "cpu dry run: host wall clock, tiny model (not GPU ground truth)"
            print(f"time {i + 1}/{len(points)} {cfg[0]} {prec}: {row['seconds'] * 1e3:.2f} ms",
                  flush=True)
            preds.measured((cfg, prec), row)
        preds.drain(budget)
    finally:
        preds.close()
    if cut:
        raise BudgetExceeded(cut)
    return {"points": len(points), "errors": errors, "predictor_device": device,
            "mape_pct": statistics.mean(abs_errors) if abs_errors else None}
