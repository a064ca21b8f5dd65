"""Ground truth on a GPU: ``torch.cuda.max_memory_allocated/reserved`` of a real training step.

Same model, inputs and :class:`predictors.step.TrainingStep` as the simulated ground truth, on
real CUDA tensors with real ``torch.autocast``. One warm-up step creates the Adam states; peak
stats are reset and the second step is measured. (Written for GPU runs; the development
machines have none, so this path is untested there.)"""

from __future__ import annotations

import time

import torch

from ..spec.model import ModelSpec
from ..step import Batch, TrainingStep
from .build import make_inputs
from .config import ShardingError, Step, resolve_shapes
from .simulate import prepare_model

GROUND_TRUTH_CUDA = "cuda: torch.cuda.max_memory_reserved of a real step"


def measure_cuda(spec: ModelSpec, cfg: Step, steps: int = 2) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("collect-memory --device cuda needs a CUDA build of torch and a GPU")
    if cfg.zero:
        raise ShardingError("the measured ground truth runs one rank without ZeRO (zero=0)")
    resolve_shapes(spec, cfg)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = prepare_model(spec, cfg, emulate=False)
    step = TrainingStep(model, cfg.precision, target="cuda",
                        loss_fn=lambda out, _: out if isinstance(out, torch.Tensor) else out.loss)
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.device("cuda"):
            kw = make_inputs(spec, model, cfg.batch, spec.seq_length or 0, spec.images_per_sample)
        step(Batch((), kw["labels"], kw))
    torch.cuda.synchronize()
    out = {"ground_truth": GROUND_TRUTH_CUDA,
           "peak_allocated": torch.cuda.max_memory_allocated(),
           "peak_reserved": torch.cuda.max_memory_reserved(),
           "peak_phase": "", "trace_seconds": time.perf_counter() - t0}
    del step, model
    torch.cuda.empty_cache()
    return out
