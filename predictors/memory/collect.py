"""``predict collect-memory``: ground-truth peak memory over a grid of configurations.

(a) on a GPU: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of a real step
    (``ground_truth="cuda"``); (b) on a CPU-only machine: the fake-tensor trace + tracker +
    caching-allocator simulation of :mod:`simulate` (``ground_truth="sim"``). Every row says
    which one it is. Output is resumable CSV (rows already present are skipped).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

from ..spec.model import LoraSpec, ModelSpec, TransformerSpec, VisionTowerSpec
from ..spec.precision import get_precision
from .config import Step
from .presets import PRESETS, scaled
from .simulate import simulate_step

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GROUND_TRUTH_CSV = DATA_DIR / "memory_ground_truth.csv"

FAMILY_BASES = {
    "llava": "llava-1.5-7b-like",
    "qwen-vl": "qwen-vl-1.5b-like",
    "blip2": "blip2-3b-like",
    "llm": "llama-7b-like",
    "vit": "vit-l-like",
}
SIZES = {"s": (0.125, 2), "m": (0.25, 3), "l": (1.0, 2)}  # tracing cost grows with depth only


def grid(quick: bool = False) -> Iterator[tuple[ModelSpec, Step, str]]:
    """(model, step, size tag) triples; ``quick`` keeps a handful for tests."""
    precisions = ("fp32", "bf16", "bf16-pure", "bf16-mixed")
    for family, base in FAMILY_BASES.items():
        for size, (width, depth) in SIZES.items():
            if quick and size != "s":
                continue
            spec = scaled(PRESETS[base], width, depth, vocab=8192)
            if spec.vision is not None:  # smaller images keep ViT tracing cheap
                spec = spec.at_resolution(spec.vision.patch_size * 12)
            for prec in precisions[:2] if quick else precisions:
                # quick: configurations the shipped grid does not contain (batch 2, seq 384)
                for batch in (2,) if quick else (1, 4):
                    at_seq = spec.with_seq(384 if quick else 512)
                    for ckpt in ("none", "full"):
                        if ckpt == "full" and (quick or get_precision(prec).autocast):
                            continue  # autocast x recompute: traceable now, not in the shipped grid yet
                        yield at_seq, Step.data_parallel(batch, prec, recompute=ckpt), size
                if family == "llava" and not quick:  # frozen vision tower (LLaVA stage 2)
                    yield (replace(spec.with_seq(512), frozen=("vision",)), Step.data_parallel(4, prec),
                           size)


# Full-size models (shapes of the public checkpoints) at batch sizes that straddle the 24-141 GiB
# cards: the OOM verdict and the held-out-by-size evaluation run on these.
XL = [
    ("llava-1.5-7b-like", "bf16", b, 2048) for b in (1, 4)
] + [
    ("qwen-vl-1.5b-like", "bf16-mixed", b, 1024) for b in (1, 4)
] + [
    ("llama-7b-like", "bf16-pure", b, 2048) for b in (1, 4)
] + [
    ("vit-b-like", "fp32", b, 1) for b in (64, 512)
] + [
    ("blip2-3b-like", "bf16-pure", b, 512) for b in (8, 32)
]


def grid_xl() -> Iterator[tuple[ModelSpec, Step, str]]:
    for name, prec, batch, seq in XL:
        yield PRESETS[name].with_seq(seq), Step.data_parallel(batch, prec), "xl"


# The CSV's ``config`` column (the columns a row was first written with, kept so every row
# reads the same): what of the model and step a row varies beyond its ``spec`` column
def row_config(spec: ModelSpec, step: Step) -> dict:
    return {"batch": step.batch, "seq": spec.seq_length or 1, "image_res": None,
            "images_per_sample": spec.images_per_sample, "precision": step.precision.name,
            "zero": step.zero, "dp": step.dp, "checkpointing": step.checkpointing,
            "attention": "eager" if spec.attention == "unfused" else spec.attention,
            "frozen": list(spec.frozen)}


def row_key(spec: ModelSpec, step: Step) -> str:
    return json.dumps([spec.name, spec.vision and spec.vision.image_size,
                       row_config(spec, step)], sort_keys=True, default=str)


def spec_to_json(spec: ModelSpec) -> str:
    return json.dumps(asdict(spec))


def spec_from_json(text: str) -> ModelSpec:
    d = json.loads(text)
    v = d.pop("vision")
    t = d.pop("text")
    # rows written before the one vocabulary named the frozen towers default_frozen
    d["frozen"] = tuple(d.pop("default_frozen", None) or d.get("frozen", ()))
    lora = d.pop("lora", None)  # rows written before LoRA have none
    return ModelSpec(vision=v and VisionTowerSpec(**v), text=t and TransformerSpec(**t),
                     lora=lora and LoraSpec(**lora), **d)


def job_from_row(row: dict) -> tuple[ModelSpec, Step]:
    """The model and step a CSV row measured (its ``spec`` and ``config`` columns; a null
    ``frozen`` keeps the spec's own, an ``image_res`` rebuilds the vision tower at it)."""
    d = json.loads(row["config"])
    spec = spec_from_json(row["spec"]).with_seq(d["seq"]).at_resolution(d["image_res"])
    spec = spec.with_attention("unfused" if d["attention"] == "eager" else d["attention"])
    spec = replace(spec, images_per_sample=d["images_per_sample"],
                   frozen=spec.frozen if d["frozen"] is None else tuple(d["frozen"]))
    return spec, Step.data_parallel(d["batch"], d["precision"], recompute=d["checkpointing"],
                                    zero=d["zero"], dp=d["dp"])


def collect(out: Path = GROUND_TRUTH_CSV, quick: bool = False, device: str = "sim") -> Path:
    """Measure every grid point not yet in ``out``; returns ``out``."""
    from tqdm import tqdm

    if device != "sim":
        from .cuda_measure import measure_cuda  # only importable with a CUDA build
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        with out.open() as f:
            done = {row_key(*job_from_row(r)) for r in csv.DictReader(f)}
    points = list(grid(quick)) + ([] if quick else list(grid_xl()))
    todo = [(s, c, z) for s, c, z in points if row_key(s, c) not in done]
    new_file = not out.exists() or not done
    with out.open("a" if done else "w", newline="") as f:
        writer = None
        for spec, cfg, size in tqdm(todo, desc="collect-memory", unit="cfg"):
            if device == "sim":
                m = simulate_step(spec, cfg).as_row()
                gt = "sim"
            else:
                m, gt = measure_cuda(spec, cfg), "cuda"
            row = {"key": row_key(spec, cfg), "ground_truth": gt, "family": spec.family,
                   "size": size, "model": spec.name, "spec": spec_to_json(spec),
                   "config": json.dumps(row_config(spec, cfg)),
                   "peak_allocated": m["peak_allocated"], "peak_reserved": m["peak_reserved"],
                   "peak_phase": m["peak_phase"], "trace_seconds": round(m["trace_seconds"], 3)}
            if writer is None:
                writer = csv.DictWriter(f, fieldnames=list(row))
                if new_file:
                    writer.writeheader()
            writer.writerow(row)
            f.flush()
    return out
