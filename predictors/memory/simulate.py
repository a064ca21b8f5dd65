"""Ground truth without a GPU: one real training step traced under ``FakeTensorMode`` on cpu.

The step is the time predictor's :class:`predictors.step.TrainingStep` (CUDA autocast rules,
fused AdamW unless another optimizer is given, fp32 masters, grad scaler). The :class:`MemoryTracker` sees every storage and
replays the stream through the caching-allocator simulator. Two steps run: the first creates
the Adam states; peaks are reset and the second (steady-state) step is the one reported, as a
GPU measurement after a warm-up step would be.

Modelled, not traced (CUDA kernel choices): SDPA runs the CPU flash kernel, which like CUDA's
FlashAttention saves only the output and the log-sum-exp; cuBLAS workspaces are allocated by
the tracker (see :mod:`overheads`); the CUDA context is outside the allocator and is added only
for the OOM verdict. Not emulated: ZeRO sharding (traced at dp=1; the analytical model shards).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..autocast import autocast_context
from ..spec.model import ModelSpec
from ..spec.precision import get_precision
from ..step import Batch, LossFn, TrainingStep, default_loss
from .allocator import CachingAllocatorSim
from .build import build_model, make_inputs, tower_modules
from .config import ShardingError, Step, resolve_shapes
from .overheads import HOPPER, CudaOverheads
from .tracker import CudaDropout, MemoryTracker

GROUND_TRUTH_SIM = "fake-tensor trace + caching-allocator simulation (cpu, CUDA rules)"


@dataclass
class Measurement:
    ground_truth: str
    peak_allocated: int
    peak_reserved: int
    peak_phase: str
    trace_seconds: float
    breakdown: dict[str, int]  # live bytes per label at the allocated peak
    phase_peaks: dict[str, int]
    saved_by_module: dict[str, int]  # activation bytes saved per module (forward end)
    segments_released: int = 0  # cached segments freed under capacity pressure
    convolutions: int = 0  # convolution ops traced (the step loads cuDNN)
    # per phase, the most bytes live at once outside the gradients (tracker.phase_peaks_without)
    phase_peaks_without_gradients: dict[str, int] = field(default_factory=dict)

    def as_row(self) -> dict:
        row = asdict(self)
        row.pop("saved_by_module")
        row.pop("segments_released")
        row.pop("convolutions")
        row.pop("phase_peaks_without_gradients")
        for k, v in row.pop("breakdown").items():
            row[f"gt_{k}"] = v
        for k, v in row.pop("phase_peaks").items():
            row[f"gt_phase_{k}"] = v
        return row


def loss_from_output(out, target):
    return out if isinstance(out, torch.Tensor) else out.loss


def prepare_model(spec: ModelSpec, cfg: Step, emulate: bool = True) -> torch.nn.Module:
    """Build, freeze and (optionally) checkpoint a model for ``cfg``."""
    model = build_model(spec, spec.attention, emulate)
    model.train()
    towers = tower_modules(spec, model)
    for name in spec.frozen:
        if name in towers:
            towers[name].requires_grad_(False)
    if cfg.checkpointing == "full":
        target = model.vision_tower if spec.text is None else model
        kwargs: dict = {"use_reentrant": False}
        if emulate and cfg.precision.autocast:
            # Real autocast state is restored for the recompute by torch.utils.checkpoint; the
            # emulation is a TorchFunctionMode it does not know, so re-enter it for recompute.
            kwargs["context_fn"] = lambda: (contextlib.nullcontext(),
                                            _recompute_autocast(cfg.precision.name))
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


@contextlib.contextmanager
def _recompute_autocast(precision: str):
    # autocast_context() enters its modes when called; checkpoint wants a context to enter later
    with autocast_context(precision, "cuda"):
        yield


def simulate_step(spec: ModelSpec, cfg: Step, overheads: CudaOverheads = HOPPER,
                  steps: int = 2) -> Measurement:
    """Trace ``steps`` training steps of ``spec`` under ``cfg``; report the last one's peaks."""
    if cfg.zero:
        raise ShardingError("the traced ground truth runs one rank without ZeRO (zero=0)")
    resolve_shapes(spec, cfg)

    def batch(model: torch.nn.Module) -> Batch:
        kw = make_inputs(spec, model, cfg.batch, spec.seq_length or 0, spec.images_per_sample)
        return Batch((), kw["labels"], kw)

    return trace_step(lambda: prepare_model(spec, cfg), batch, cfg.precision.name,
                      loss_fn=loss_from_output, overheads=overheads, steps=steps)


def trace_step(build: Callable[[], torch.nn.Module],
               batch: Callable[[torch.nn.Module], Batch], precision: str, *,
               loss_fn: LossFn = default_loss,
               make_optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
               overheads: CudaOverheads = HOPPER, capacity: int | None = None,
               steps: int = 2, inference_forward: bool = False) -> Measurement:
    """Trace ``steps`` training steps of the module ``build()`` returns (called under
    ``FakeTensorMode``) on inputs from ``batch(model)``; the last step's peaks are reported.
    ``capacity`` bounds the simulated allocator: under pressure it frees its cached segments
    and retries, and raises :class:`SimulatedOutOfMemoryError` when even that fails.
    ``inference_forward``: before training, one forward in eval mode under ``no_grad`` on the
    first ``batch(model)`` (what ``torchinfo.summary(model, input_size=...)`` runs on the
    model's device); its blocks stay in the cache the training steps then split and reuse.
    That batch's target is allocated too (torchinfo makes none): a labels-sized block the
    first step's labels would take anyway."""
    t0 = time.perf_counter()
    tracker = MemoryTracker(CachingAllocatorSim(capacity), overheads=overheads,
                            tf32=get_precision(precision).tf32)
    with FakeTensorMode():
        model = build()
        step = TrainingStep(model, precision, target="cuda", loss_fn=loss_fn,
                            on_phase=lambda p: _enter_phase(tracker, p),
                            make_optimizer=make_optimizer)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.register_post_accumulate_grad_hook(lambda q: tracker.relabel([q.grad], "gradient"))
        if step.optimizer is not None:
            step.optimizer.register_step_pre_hook(lambda opt, a, k: tracker.relabel(
                [q.grad for g in opt.param_groups for q in g["params"]], "gradient"))
        hooks = tracker.attach(model)
        with tracker, CudaDropout():
            tracker.register(model.parameters(), "parameter")
            tracker.register(model.buffers(), "parameter")
            tracker.register(step.masters, "optimizer_state")
            if inference_forward:
                step.inference(batch(model))
            for i in range(steps):
                if i == steps - 1:
                    tracker.phase = "setup"
                    tracker.reset_peak()
                step(batch(model))
                tracker.phase = "setup"
                if step.optimizer is not None:
                    tracker.relabel(
                        [v for s in step.optimizer.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor)], "optimizer_state")
        for h in hooks:
            h.remove()
    s = tracker.allocator.stats
    return Measurement(
        ground_truth=GROUND_TRUTH_SIM,
        peak_allocated=s.peak_allocated,
        peak_reserved=s.peak_reserved,
        peak_phase=tracker.peak.phase,
        trace_seconds=time.perf_counter() - t0,
        breakdown=tracker.peak_breakdown(),
        phase_peaks=dict(tracker.phase_peaks),
        saved_by_module=dict(tracker.module_saved),
        segments_released=s.num_releases,
        convolutions=tracker.convolutions,
        phase_peaks_without_gradients=tracker.phase_peaks_without("gradient"),
    )


def _enter_phase(tracker: MemoryTracker, phase: str) -> None:
    if tracker.phase == "forward" or (tracker.phase == "loss" and phase == "backward"):
        tracker.end_forward()
    tracker.phase = phase
