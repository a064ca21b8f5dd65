"""Python API: ``predict_peak_memory`` (used by CONA to drop candidates that do not fit).

Tensor and pipeline parallelism follow Megatron-Core's layouts, per rank, as Megatron-Bridge's
memory estimator does: the rank on the FIRST pipeline stage (the one holding the most
activations) runs ``num_layers / pp`` text layers; weights, gradients and optimizer states of
its layers and of the vocabulary-parallel embedding/head are split ``tp`` ways; per layer the
activations are ``s*b*h*(10 + 24/tp + 5*a*s/(h*tp))`` bytes at 2 B per element (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, Table 2; with
sequence parallelism all of it is split: ``(34 + 5*a*s/h)/tp``); under 1F1B the first stage
holds the activations of ``min(pp, micro-batches)`` micro-batches in flight. The CUDA
context is per process and is never divided by ``tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..spec.model import ModelSpec, ModelSpecError, TransformerSpec
from ..spec.options import TrainingOptions
from ..spec.strategy import ParallelStrategy
from .allocator import GiB
from .config import CHECKPOINTING, ShardingError, TrainConfig
from .model import MemoryModel
from .overheads import CARDS, HOPPER, PRE_HOPPER
from .presets import PRESET_SEQ, as_memory_model


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
    tp: int = 1
    pp: int = 1
    inflight_microbatches: int = 1  # activations held at once on the first pipeline stage

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
                 f"checkpointing {self.config.checkpointing}, attention {self.config.attention}, "
                 f"tp {self.tp} pp {self.pp} (first stage, {self.inflight_microbatches} "
                 "micro-batch(es) in flight)",
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


def predict_peak_memory(model: str | ModelSpec | TransformerSpec, *, batch: int = 1,
                        seq: int | None = None,
                        image_res: int | None = None, images_per_sample: int = 1,
                        precision: str = "bf16", zero: int = 0, dp: int = 1,
                        checkpointing: str = "none", attention: str = "flash",
                        frozen: tuple[str, ...] | None = None, capacity_gib: float | str = 80,
                        margin: float | None = None, tp: int = 1, pp: int = 1,
                        num_microbatches: int | None = None,
                        sequence_parallel: bool = False,
                        strategy: ParallelStrategy | None = None,
                        options: TrainingOptions | None = None,
                        architecture: str | None = None) -> MemoryPrediction:
    """Predict one GPU's peak memory for a training step and whether it fits ``capacity_gib``
    (a number of GiB, or a card key of :data:`overheads.CARDS` such as ``"141"``). ``margin``
    fixes the relative safety margin; by default it is the model's predicted uncertainty.
    ``tp``/``pp``: Megatron-Core tensor/pipeline parallel sizes (the prediction is the first
    pipeline stage's rank, with its own depth where ``strategy`` splits the layers unevenly:
    ``first_stage_layers``); ``num_microbatches`` per iteration (default: ``pp``, a full
    pipeline); ``batch`` is the micro-batch. ``model`` is a preset name, a model or a text tower
    alone (:func:`predictors.memory.presets.as_memory_model`); ``seq`` defaults to the text
    tower's ``seq_length``. ``strategy`` (the one :class:`ParallelStrategy`) gives ``batch``,
    ``dp``, ``tp``, ``pp`` and ``num_microbatches`` in their place; ``options`` (the one
    :class:`TrainingOptions`) give ``zero`` (distributed optimizer: 1, FSDP: 3) and
    ``checkpointing`` (its ``recompute``). ``architecture`` (``"hopper"`` or ``"pre-hopper"``)
    names the GPU generation whose CUDA context and allocator overheads apply; by default a card
    key's own, else Hopper's above 48 GiB (an A100-80GB is not Hopper: say so)."""
    if options is not None:
        if options.recompute not in CHECKPOINTING:
            raise ModelSpecError(f"recompute={options.recompute!r} is not modelled by the memory "
                                 f"predictor; choose one of {CHECKPOINTING}")
        checkpointing = options.recompute
        zero = 3 if options.fsdp else int(options.distributed_optimizer)
    if strategy is not None:
        if strategy.cp > 1:
            raise ShardingError(f"strategy {strategy.name}: cp={strategy.cp} is not modelled by "
                                "the memory predictor (context parallelism)")
        batch, dp, tp, pp = strategy.micro_batch, strategy.dp, strategy.tp, strategy.pp
        num_microbatches = strategy.num_microbatches
    spec = as_memory_model(model)
    first_stage = None  # the first stage's depth where the strategy sets an uneven split
    if strategy is not None and strategy.uneven:
        if spec.text is None:
            raise ShardingError(f"strategy {strategy.name}: an uneven pipeline split needs a "
                                "text tower")
        first_stage = strategy.stage_layers(spec.text.num_layers)[0]
    if seq is None:
        seq = spec.text.seq_length if spec.text is not None else PRESET_SEQ
    if tp < 1 or pp < 1:
        raise ShardingError(f"tp={tp}, pp={pp} must be >= 1")
    if first_stage is not None:  # Megatron's --decoder-first-pipeline-num-layers
        spec = spec.with_layers(None, first_stage)
    elif pp > 1:
        if spec.text is None or spec.text.num_layers % pp:
            layers = spec.text.num_layers if spec.text else 0
            raise ShardingError(f"pp={pp} must divide the text tower's num_layers={layers}")
        spec = spec.with_layers(None, spec.text.num_layers // pp)
    if spec.text is not None and tp > 1 and (spec.text.num_attention_heads % tp
                                                or spec.text.kv_heads % tp):
        raise ShardingError(f"tp={tp} must divide num_attention_heads="
                            f"{spec.text.num_attention_heads} and num_query_groups="
                            f"{spec.text.kv_heads}")
    cfg = TrainConfig(batch=batch, seq=seq, image_res=image_res,
                      images_per_sample=images_per_sample, precision=precision, zero=zero,
                      dp=dp, checkpointing=checkpointing, attention=attention, frozen=frozen)
    spec = spec.at_resolution(image_res)
    if str(capacity_gib) in CARDS:
        capacity, overheads = CARDS[str(capacity_gib)]
    else:
        capacity = int(float(capacity_gib) * GiB)
        overheads = HOPPER if capacity > 48 * GiB else PRE_HOPPER
    if architecture is not None:
        by_name = {o.name: o for o in (HOPPER, PRE_HOPPER)}
        if architecture not in by_name:
            raise ModelSpecError(f"architecture={architecture!r}: choose one of "
                                 f"{', '.join(by_name)}")
        overheads = by_name[architecture]
    reserved, est, predicted_margin = _shipped_model().predict(spec, cfg, overheads)
    margin = predicted_margin if margin is None else margin
    inflight = min(pp, num_microbatches or pp)
    comps = dict(est.components)
    if tp > 1 or inflight > 1:
        comps = per_rank_components(comps, tp, inflight, _activation_tp_share(
            spec, cfg, tp, sequence_parallel))  # fmt: skip
        # the allocator's overhead over live bytes is kept in proportion
        reserved = int(reserved * sum(comps.values()) / max(sum(est.components.values()), 1))
    return MemoryPrediction(spec.name, cfg, reserved, sum(comps.values()), est.peak_phase,
                            comps, overheads.context_bytes, capacity, margin,
                            _shipped_model().trained_on, tp, pp, inflight)


SHARDED_BY_TP = ("parameters", "gradients", "optimizer_states", "transient")


def per_rank_components(components: dict[str, int], tp: int, inflight: int,
                        activation_share: float) -> dict[str, int]:
    """One rank's live bytes from the single-GPU breakdown of its stage: weights, gradients,
    states and per-layer transients split ``tp`` ways, activations by ``activation_share``
    and held for ``inflight`` micro-batches; inputs and cuBLAS workspaces per rank as is."""
    out = {}
    for k, v in components.items():
        if k in SHARDED_BY_TP:
            v = v // tp
        elif k == "activations":
            v = int(v * activation_share * inflight)
        out[k] = v
    return out


def _activation_tp_share(spec: ModelSpec, cfg: TrainConfig, tp: int, sp: bool) -> float:
    """Fraction of a layer's activations one TP rank keeps (Korthikanti et al. 2022)."""
    if tp == 1:
        return 1.0
    t = spec.text
    if t is None:
        return 1.0 / tp
    # flash attention keeps no s x s scores: the 5as/h term is absent
    heads = t.num_attention_heads
    scores = 0.0 if cfg.attention == "flash" else 5 * heads * cfg.seq / t.hidden_size
    full = 34 + scores
    return 1 / tp if sp else (10 + 24 / tp + scores / tp) / full
