"""Python API: ``predict_peak_memory`` (used by CONA to drop candidates that do not fit)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .allocator import GiB
from .model import MemoryModel
from .overheads import CARDS, HOPPER, PRE_HOPPER
from .presets import get_preset
from .towers import ModelSpec, TrainConfig


@dataclass
class MemoryPrediction:
    model: str
    config: TrainConfig
    peak_reserved: int  # predicted torch.cuda.max_memory_reserved of one steady-state step
    peak_allocated_analytical: int  # analytical max of live bytes (before the residual)
    peak_phase: str
    components: dict[str, int]  # analytical live bytes by kind at the peak
    context_bytes: int  # CUDA context, outside the caching allocator
    capacity: int
    margin: float  # relative safety margin (predicted uncertainty unless fixed)
    trained_on: str  # what the residual model was trained against

    @property
    def device_used(self) -> int:
        """Device-level memory (``nvidia-smi`` ``memory.used``): reserved + CUDA context."""
        return self.peak_reserved + self.context_bytes

    @property
    def device_total(self) -> int:
        return int(self.peak_reserved * (1 + self.margin)) + self.context_bytes

    @property
    def fits(self) -> bool:
        return self.device_total <= self.capacity

    def format(self) -> str:
        g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        lines = [f"model {self.model}: {self.config.precision}, batch {self.config.batch}, "
                 f"seq {self.config.seq}, zero {self.config.zero} (dp {self.config.dp}), "
                 f"checkpointing {self.config.checkpointing}, attention {self.config.attention}",
                 f"analytical breakdown at the {self.peak_phase} peak:"]
        for k, v in self.components.items():
            lines.append(f"  {k:17s}{g(v)}")
        lines += [
            f"  {'analytical peak':17s}{g(self.peak_allocated_analytical)}",
            f"predicted peak reserved {g(self.peak_reserved)} (residual model trained on: "
            f"{self.trained_on})",
            f"device-level (nvidia-smi memory.used) = reserved + CUDA context "
            f"{g(self.context_bytes)} = {g(self.device_used)}",
            f"+ safety margin {self.margin:.1%} of reserved = "
            f"{g(self.device_total)} of {g(self.capacity)}",
            f"verdict: {'FITS' if self.fits else 'OUT OF MEMORY'}",
        ]
        return "\n".join(lines)


@lru_cache(maxsize=1)
def _shipped_model() -> MemoryModel:
    return MemoryModel.load()


def predict_peak_memory(model: str | ModelSpec, *, batch: int = 1, seq: int = 2048,
                        image_res: int | None = None, images_per_sample: int = 1,
                        precision: str = "bf16", zero: int = 0, dp: int = 1,
                        checkpointing: str = "none", attention: str = "flash",
                        frozen: tuple[str, ...] | None = None, capacity_gib: float | str = 80,
                        margin: float | None = None) -> MemoryPrediction:
    """Predict one GPU's peak memory for a training step and whether it fits ``capacity_gib``
    (a number of GiB, or a card key of :data:`overheads.CARDS` such as ``"141"``). ``margin``
    fixes the relative safety margin; by default it is the model's predicted uncertainty."""
    spec = get_preset(model) if isinstance(model, str) else model
    cfg = TrainConfig(batch=batch, seq=seq, image_res=image_res,
                      images_per_sample=images_per_sample, precision=precision, zero=zero,
                      dp=dp, checkpointing=checkpointing, attention=attention, frozen=frozen)
    spec = spec.at_resolution(image_res)
    if str(capacity_gib) in CARDS:
        capacity, overheads = CARDS[str(capacity_gib)]
    else:
        capacity = int(float(capacity_gib) * GiB)
        overheads = HOPPER if capacity > 48 * GiB else PRE_HOPPER
    reserved, est, predicted_margin = _shipped_model().predict(spec, cfg, overheads)
    margin = predicted_margin if margin is None else margin
    return MemoryPrediction(spec.name, cfg, reserved, est.peak_allocated, est.peak_phase,
                            est.components, overheads.context_bytes, capacity, margin,
                            _shipped_model().trained_on)
