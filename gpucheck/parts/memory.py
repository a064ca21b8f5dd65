"""(2) Memory ground truth: real training steps over a grid, with the memory predictor's
prediction next to each row.

Grid: LLaVA-like (CLIP ViT + projector + Llama), a ViT, a decoder LLM (the predictor's presets,
scaled down, built by the predictor's own model builder), an MLP and a CNN; fp32, bf16
autocast, bf16 pure, fp16 autocast + GradScaler; fused and foreach AdamW; activation
checkpointing on/off. Then the ``vision`` family: torchvision's ResNet-18/50, DenseNet-121 (the
concat-heavy one), VGG-16 and a U-Net (``support.convnets``) at two batch sizes each, fp32, tf32 and
bf16 autocast, foreach AdamW (torch's default on CUDA), as a PyTorch user trains them. Per row: one warm-up step (creates the Adam states), peak stats reset,
one measured step; ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and NVML's
device-level used bytes (CUDA context and every other process included) before and after.
The dry run executes the same steps on the CPU (no CUDA memory statistics: rows ``skipped``).
"""

from __future__ import annotations

import gc
import gzip
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from gpucheck import adapters
from gpucheck.common import (
    NO_GPU,
    Budget,
    BudgetExceeded,
    PartContext,
    RowWriter,
    error_text,
    nvml_used_bytes,
)
from gpucheck.predictions import Predictions
from gpucheck.schema import EVENTS_FILE
from gpucheck.steps import MLP, RealStep, count_params
from support import convnets

FILE = "memory.csv"
GROUND_TRUTH = "cuda: torch.cuda.max_memory_reserved of a real step (gpu_check)"
PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16")
CAPACITY_GIB = 141


@dataclass(frozen=True)
class Point:
    family: str  # llava | vit | llm | mlp | cnn | vision
    size: str
    precision: str
    optimizer: str
    checkpointing: str
    model: str = ""  # vision: a support.convnets name
    batch: int = 0  # vision; a preset's batch instead of PRESET_MODELS' (0: that one)


# (preset, width, depth, vocab, image_res, seq, batch) per family and size
PRESET_MODELS = {
    "gpu": {
        "llava": ("llava-1.5-7b-like", 0.25, 4, 32064, 336, 1024, 4),
        "vit": ("vit-l-like", 0.5, 8, None, 224, 1, 32),
        "llm": ("llama-7b-like", 0.25, 4, 32064, None, 2048, 4),
    },
    "tiny": {
        # LLaVA's image token id is 32000: the vocabulary must contain it on a real device
        "llava": ("llava-1.5-7b-like", 0.0625, 1, 32064, 28, 16, 1),
        "vit": ("vit-b-like", 0.125, 1, None, 32, 1, 2),
        "llm": ("llama-7b-like", 0.0625, 1, 8192, None, 16, 1),
    },
}
# LLaVA-style tower (ViT + projector + small LLM) in bf16 autocast at a second batch size beside
# the grid's (issue 45 item 5): with GPUCHECK_MEMORY_EVENTS=1 its two event streams are the
# multimodal verdict's ground truth as the conv nets' streams are the workspace model's
LLAVA_EVENT_BATCHES = {"gpu": 8, "tiny": 2}
MLP_SIZES = {"gpu": (1024, 4096, 8, 1000, 2048), "tiny": (32, 64, 2, 10, 4)}  # in, hid, L, C, B
CNN_SIZES = {"gpu": ((64, 128, 256), 2, 224, 64), "tiny": ((8, 16), 1, 16, 2)}
# vision: model -> (image side, batch sizes); tiny: the dry run's small images
VISION = {"gpu": {"resnet18": (224, (64, 256)), "resnet50": (224, (32, 128)),
                  "densenet121": (224, (32, 128)), "vgg16": (224, (16, 64)),
                  "unet": (256, (8, 32))},
          "tiny": {"densenet121": (32, (2,)), "unet": (32, (1,))}}
# tf32: PyTorch's default for convolutions (torch.backends.cudnn.allow_tf32 is True)
VISION_PRECISIONS = ("fp32", "tf32", "bf16")
# GPUCHECK_MEMORY_FAMILIES=vision,mlp: measure only those families (a rerun of a few)
FAMILIES_ENV = "GPUCHECK_MEMORY_FAMILIES"
# GPUCHECK_MEMORY_EVENTS=1: the caching allocator's events of each measured step (every
# alloc / free / segment with size, address and stream; no stacks) and its segments before and
# after, one JSON line per point, into schema.EVENTS_FILE: the real event stream the
# simulator's allocator is compared with offline (issue #37)
EVENTS_ENV = "GPUCHECK_MEMORY_EVENTS"


def grid(tiny: bool) -> list[Point]:
    """GPU: the vision points first (a second or two each: the conv-net ground truth), then
    every family x precision x optimizer x checkpointing (no checkpointed CNN) in a fixed
    shuffle, so a cut by the budget still covers every family; dry run: one point per family,
    together covering every precision, optimizer and checkpointing value."""
    size = "tiny" if tiny else "gpu"
    points = [Point(family, size, prec, opt, ckpt)
              for family in ("llava", "vit", "llm", "mlp", "cnn") for prec in PRECISIONS
              for opt in ("fused", "foreach") for ckpt in ("none", "full")
              if not (family == "cnn" and ckpt == "full")]  # the zoo's CNN: no checkpointing
    points.append(Point("llava", size, "bf16", "foreach", "none",
                        batch=LLAVA_EVENT_BATCHES[size]))
    random.Random(0).shuffle(points)
    points = [Point("vision", size, prec, "foreach", "none", model, b)
              for model, (_, batches) in VISION[size].items() for b in batches
              for prec in VISION_PRECISIONS] + points
    if only := os.environ.get(FAMILIES_ENV):
        points = [p for p in points if p.family in only.split(",")]
    if tiny:
        want = {("llava", "fp32", "fused", "none"), ("vit", "bf16", "foreach", "full"),
                ("llm", "fp16", "fused", "full"), ("mlp", "bf16-pure", "foreach", "full"),
                ("cnn", "fp16", "foreach", "none")}
        points = [p for p in points if p.family == "vision" and p.precision == "bf16"
                  or (p.family, p.precision, p.optimizer, p.checkpointing) in want]
    return points


def _preset(point: Point):
    base, width, depth, vocab, res, seq, batch = PRESET_MODELS[point.size][point.family]
    spec = adapters.memory_scaled(base, width, depth, vocab or 8192, res, seq)
    cfg = adapters.memory_step(point.batch or batch, point.precision, point.checkpointing)
    return spec, cfg


def _build(point: Point, device: str):
    """(model, positional inputs, kwargs, target, (spec, cfg) of a preset or None, batch)."""
    import torch

    if point.family in PRESET_MODELS["gpu"]:
        spec, cfg = _preset(point)
        with torch.device(device):
            model = adapters.build_memory_model(spec, cfg)
        kw = {k: v.to(device) for k, v in adapters.memory_inputs(spec, model, cfg).items()}
        return model, [], kw, None, (spec, cfg), cfg.batch
    if point.family == "mlp":
        d_in, hidden, layers, classes, batch = MLP_SIZES[point.size]
        with torch.device(device):
            model = MLP(d_in, hidden, layers, classes, point.checkpointing == "full")
        x = torch.randn(batch, d_in).to(device)
        y = torch.randint(0, classes, (batch,)).to(device)
        return model, [x], {}, y, None, batch
    if point.family == "vision":
        image = VISION[point.size][point.model][0]
        with torch.device(device):
            model = convnets.build(point.model)
        x, y = convnets.batch(point.model, point.batch, image, device)
        return model, [x], {}, y, None, point.batch
    from predictors.time.zoo import ConvNetSpec

    widths, blocks, image, batch = CNN_SIZES[point.size]
    spec = ConvNetSpec("convnet", widths, blocks, image)
    with torch.device(device):
        model = adapters.build_time_model(spec)
    inputs, target = adapters.time_batch(spec, batch)
    return model, [t.to(device) for t in inputs], {}, target.to(device), None, batch


def predict_point(point: Point) -> dict:
    """The memory predictor's answers for one grid point (in a worker process on a GPU run,
    so predictions overlap the measurements). Presets: the shipped default
    (``predict_peak_memory``, residual model) and the traced path (``predict_spec_memory``);
    MLP and CNN: the ``nn.Module`` API on a meta-device model (nothing allocated)."""
    out: dict = {}
    notes = []
    try:
        if point.family in PRESET_MODELS["gpu"]:
            spec, cfg = _preset(point)
            try:
                p = adapters.predict_memory(spec, cfg, CAPACITY_GIB)
                out["pred_peak_reserved"] = p["peak_reserved"]
                notes.append(f"predict_peak_memory (trained on {p['trained_on']})")
            except Exception as exc:  # noqa: BLE001 - the traced path may still answer
                notes.append(f"predict_peak_memory failed: {error_text(exc, 150)}")
            t = adapters.predict_memory_traced(spec, cfg, point.optimizer)
            notes.append("traced: predict_spec_memory")
        else:
            model, inputs, kw, target, _, _ = _build(point, "meta")
            t = adapters.predict_memory_module(model, inputs, kw, target, point.precision,
                                               point.optimizer)
            out["pred_peak_reserved"] = t["peak_reserved"]
            notes.append("predict_module_memory (nn.Module API)")
        out.update(pred_traced_reserved=t["peak_reserved"], pred_device_used=t["device_used"])
    except Exception as exc:  # noqa: BLE001 - the ground truth row still stands
        notes.append(f"prediction failed: {error_text(exc, 200)}")
    out["pred_note"] = "; ".join(notes)
    return out


def _recorded_step(step, inputs, kw, target, events) -> None:
    """The measured step with the allocator's history on; one JSON line into ``events``."""
    import torch

    from predictors.memory.cuda_events import compact

    before, _ = compact(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    try:
        step(inputs, kw, target)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    after, trace = compact(snap)
    events.write(json.dumps({"segments_before": before, "events": trace,
                             "segments_after": after}) + "\n")


WARMUP_MAX_STEPS = 32  # GradScaler halves its 2**16 scale per skipped step


def measure(point: Point, device: str, events=None) -> dict:
    """Warm-up steps (one, or until the optimizer holds its states), peak statistics reset,
    one measured step (the steady state);
    ``events``: a text file the measured step's allocator events go to (CUDA only)."""
    import torch

    cuda = device == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    before = nvml_used_bytes() if cuda else None
    t0 = time.perf_counter()
    model, inputs, kw, target, pair, batch = _build(point, device)
    step = RealStep(model, point.precision, device, point.optimizer)
    params = count_params(model)
    step(inputs, kw, target)  # warm-up: Adam states, cuBLAS workspaces, autotuning
    # fp16's GradScaler skips optimizer.step() while its scale overflows (a non-fused AdamW
    # then has no states yet: predictors.memory.evaluate.skipped_step); warm up until it ran
    for _ in range(WARMUP_MAX_STEPS - 1):
        if step.optimizer is None or step.optimizer.state:
            break
        step(inputs, kw, target)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    recorded = False
    if cuda and events is not None:
        try:
            _recorded_step(step, inputs, kw, target, events)
            recorded = True
        except Exception as exc:  # noqa: BLE001 - the measurement matters more than its events
            events.write(json.dumps({"error": error_text(exc)}) + "\n")
            torch.cuda.reset_peak_memory_stats()
    if not recorded:
        step(inputs, kw, target)
    row: dict = {"family": point.family, "size": point.size, "precision": point.precision,
                 "optimizer": point.optimizer, "checkpointing": point.checkpointing,
                 "batch": batch, "params": params, "ground_truth": GROUND_TRUTH,
                 "peak_phase": ""}
    if cuda:
        torch.cuda.synchronize()
        row.update(peak_allocated=torch.cuda.max_memory_allocated(),
                   peak_reserved=torch.cuda.max_memory_reserved(),
                   nvml_used_before=before, nvml_used_peak=nvml_used_bytes(), status="ok")
    else:
        row.update(status="skipped", note=f"{NO_GPU}: the step ran on the cpu in "
                   f"{time.perf_counter() - t0:.2f} s; CUDA memory statistics need a GPU")
    row["trace_seconds"] = round(time.perf_counter() - t0, 3)
    if pair is not None:
        spec, cfg = pair
        row.update(adapters.memory_row_fields(spec, cfg), model=spec.name)
        row["key"] += f"|{point.optimizer}"  # collect-memory's key has no optimizer
    else:
        name = point.model or f"{point.family}-{point.size}"
        if point.family == "vision":
            row["note"] = "; ".join(filter(None, [row.get("note"),
                                                  _torchvision_check(point.model, params)]))
            name = f"{name}-b{batch}"
        row.update(key=f"{name}|{point.precision}|{point.optimizer}|{point.checkpointing}",
                   model=name, config={"batch": batch, "precision": point.precision,
                                       "checkpointing": point.checkpointing})
    del step, model, inputs, kw
    return row


def _torchvision_check(model: str, params: int) -> str:
    """Where torchvision is installed (the GPU image), its parameter count beside ours."""
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - absent or broken beside a CPU torch
        return "torchvision not importable: parameter count not compared"
    if model not in convnets.TORCHVISION_PARAMS:
        return "no torchvision model of that name"
    theirs = count_params(torchvision.models.get_model(model, weights=None))
    return f"params {params} vs torchvision {torchvision.__version__} {theirs}"


def _finish(row: dict, pred: dict) -> dict:
    row = {**row, **pred}
    if row.get("peak_reserved"):
        for pred, err in (("pred_peak_reserved", "pred_error_pct"),
                          ("pred_traced_reserved", "pred_traced_error_pct")):
            if row.get(pred):
                row[err] = 100.0 * (row[pred] - row["peak_reserved"]) / row["peak_reserved"]
    return row


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    points = grid(ctx.dry_run)
    abs_errors: list[float] = []

    def merge(row: dict, pred: dict) -> dict:
        row = _finish(row, pred)
        if "pred_error_pct" in row:
            abs_errors.append(abs(row["pred_error_pct"]))
        return row

    events = None
    if os.environ.get(EVENTS_ENV) and ctx.device == "cuda":
        events = gzip.open(Path(ctx.out) / EVENTS_FILE, "wt")
    preds = Predictions(predict_point, merge, w, parallel=not ctx.dry_run)
    for point in points:
        preds.submit(point, point)
    measured, errors, cut = 0, 0, None
    try:
        for i, point in enumerate(points):
            # on a GPU run, leave a quarter of the budget for predictions still in the pool
            if budget.expired(reserve=3.0 if ctx.dry_run else 0.25 * budget.seconds):
                cut = f"memory grid cut at {i}/{len(points)} points by the budget"
                break
            try:
                if events is not None:
                    events.write(json.dumps({"point": point.__dict__}) + "\n")
                preds.measured(point, measure(point, ctx.device, events))
                measured += 1
            except Exception as exc:  # noqa: BLE001 - one configuration failing (OOM...)
                errors += 1
                w.write(family=point.family, size=point.size, precision=point.precision,
                        optimizer=point.optimizer, checkpointing=point.checkpointing,
                        status="error", note=error_text(exc))
            print(f"memory {i + 1}/{len(points)} {point}", flush=True)
        preds.drain(budget)
    finally:
        preds.close()
        if events is not None:
            events.close()
    if cut:
        raise BudgetExceeded(cut)
    return {"points": len(points), "measured": measured, "errors": errors,
            "mape_pct": sum(abs_errors) / len(abs_errors) if abs_errors else None}
