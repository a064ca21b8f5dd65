"""Python API: ``predict_peak_memory`` (used by CONA to drop candidates that do not fit).

Tensor and pipeline parallelism follow Megatron-Core's layouts, per rank, as Megatron-Bridge's
memory estimator does. Each pipeline stage is priced with what Megatron-Core's GPTModel puts
there (``megatron/core/models/gpt/gpt_model.py``, ``pre_process`` / ``post_process``): its
text layers (``num_layers / pp``, or the strategy's uneven split), the input embedding on the
first stage (with a multimodal model's vision tower and projector), the final norm, output
layer (its own copy of tied word embeddings) and the logits and loss on the last; under 1F1B
stage ``i`` (0-based) holds the activations of ``min(pp - i, micro-batches)`` micro-batches in
flight. The prediction is the stage with the largest device total. Weights, gradients and
optimizer states of its layers and of the vocabulary-parallel embedding/head are split ``tp``
ways; per layer the activations are ``s*b*h*(10 + 24/tp + 5*a*s/(h*tp))`` bytes at 2 B per
element (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, Table 2; with sequence parallelism all of it is split: ``(34 + 5*a*s/h)/tp``). The
residual model, trained on single-GPU steps, is applied to each stage's part of the model as
to a whole one. The CUDA context is per process and is never divided by ``tp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from ..spec.model import ModelSpec, ModelSpecError, TransformerSpec
from ..spec.options import DEFAULT_OPTIONS, TrainingOptions
from ..spec.precision import Precision
from ..spec.strategy import ParallelStrategy
from .allocator import GiB
from .config import SINGLE_GPU, ShardingError, Step
from .device import (
    CommBuffers,
    deepspeed_buckets,
    grad_buffers,
    nccl_communicators,
    pipeline_buffers,
    replaces_gradients,
    step_copy,
    unmodelled_zero,
    unpriced_framework,
    unrun_precision,
)
from .factorize import factorize
from .model import MemoryModel, margin_family
from .overheads import CARDS, HOPPER, PRE_HOPPER, CudaOverheads
from .phases import trainable_params, trainable_tensors, walk_phases
from .presets import as_memory_model
from .verdict import Judgement, Margin, Verdict, judge, margin_for
from .zero import PREFETCH_BUCKET


@dataclass
class MemoryPrediction:
    model: ModelSpec  # the predicted pipeline stage's part of the model, as walked
    step: Step
    peak_reserved: int  # predicted torch.cuda.max_memory_reserved of one steady-state step
    peak_allocated_analytical: int  # analytical max of live bytes (before the residual)
    peak_phase: str
    components: dict[str, int]  # analytical live bytes by kind at the peak
    context_bytes: int  # CUDA context, outside the caching allocator
    capacity: int
    margin: Margin  # bounds of the reserved bytes the verdict compares (verdict.py)
    trained_on: str  # what the residual model was trained against
    inflight_microbatches: int = 1  # micro-batches whose activations the stage holds at once
    # NCCL's buffers by communicator (device.nccl_communicators), outside the caching allocator
    nccl: dict[str, int] = field(default_factory=dict)
    stage: int = 0  # the pipeline stage predicted (0-based): the largest device total

    @property
    def nccl_bytes(self) -> int:
        return sum(self.nccl.values())

    @property
    def outside_allocator(self) -> int:
        """Bytes outside the caching allocator: the CUDA context and NCCL's buffers."""
        return self.context_bytes + self.nccl_bytes

    @property
    def device_used(self) -> int:
        """Device-level memory (``nvidia-smi`` ``memory.used``): reserved + CUDA context +
        NCCL's buffers."""
        return self.peak_reserved + self.outside_allocator

    @property
    def judgement(self) -> Judgement:
        return judge(self.peak_reserved, self.outside_allocator, self.capacity, self.margin)

    @property
    def device_total(self) -> int:
        """Device-level memory at the upper bound of the reserved bytes."""
        return self.judgement.upper + self.outside_allocator

    @property
    def fits(self) -> bool:
        """Only a ``fits`` verdict: a ``tight`` job is not promised to fit."""
        return self.judgement.verdict is Verdict.FITS

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model.name, "max_memory_reserved": self.peak_reserved,
                "peak_allocated_analytical": self.peak_allocated_analytical,
                **{f"analytical.{k}": v for k, v in self.components.items()},
                "cuda_context": self.context_bytes, **self.nccl,
                "nccl_buffers": self.nccl_bytes,
                "device_used": self.device_used,
                "pipeline_stage": self.stage,
                "capacity": self.capacity, **self.judgement.as_dict()}

    def format(self) -> str:
        g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        st, m = self.step, self.model
        lines = [f"model {m.name}: {st.precision.name}, batch {st.batch}, "
                 f"seq {m.seq_length}, zero {st.zero} (dp {st.dp}), "
                 f"checkpointing {st.checkpointing}, attention {m.attention}, "
                 f"tp {st.strategy.tp} pp {st.strategy.pp} (stage {self.stage + 1} of "
                 f"{st.strategy.pp}, the largest device total; {self.inflight_microbatches} "
                 "micro-batch(es) in flight)",
                 f"analytical breakdown at the {self.peak_phase} peak:"]
        for k, v in self.components.items():
            lines.append(f"  {k:17s}{g(v)}")
        lines += [
            f"  {'analytical peak':17s}{g(self.peak_allocated_analytical)}",
            f"predicted peak reserved {g(self.peak_reserved)} (residual model trained on: "
            f"{self.trained_on})",
            f"device-level (nvidia-smi memory.used) = reserved + CUDA context "
            f"{g(self.context_bytes)}"
            + "".join(f" + NCCL {k.removeprefix('nccl_')} communicator {g(v)}"
                      for k, v in self.nccl.items())
            + f" = {g(self.device_used)}",
            self.judgement.describe(),
        ]
        return "\n".join(lines)


@lru_cache(maxsize=1)
def _shipped_model() -> MemoryModel:
    return MemoryModel.load()


def predict_peak_memory(model: str | ModelSpec | TransformerSpec,
                        strategy: ParallelStrategy = SINGLE_GPU,
                        options: TrainingOptions = DEFAULT_OPTIONS,
                        precision: str | Precision = "bf16", capacity_gib: float | str = 80, *,
                        architecture: str | None = None,
                        margin: float | None = None,
                        buffers: CommBuffers | None = None) -> MemoryPrediction:
    """Predict one GPU's peak memory for a training step and whether it fits, in the one
    vocabulary of :mod:`predictors.spec`. ``model``: a preset name, a model or a text tower
    alone (:func:`predictors.memory.presets.as_memory_model`; its sequence length, image
    resolution, attention, frozen towers and images per sample are the model's own).
    ``strategy``: its micro-batch is the batch, ``dp`` what ZeRO shards over, ``tp``/``pp``
    Megatron-Core's tensor/pipeline sizes (the prediction is the rank of the pipeline stage
    with the largest device total, ``stage``: each stage with its own depth, the first with
    the embedding, the last with the output layer and loss), its micro-batch count sets how many
    are in flight on each stage. ``options``: the ZeRO stage (distributed optimizer: 1,
    ``shard_gradients``: 2, FSDP: 3; one the framework is not modelled at is refused,
    :func:`device.unmodelled_zero`, as is a framework beyond one rank whose buffers are not
    priced: torchtitan's and LLM Foundry's FSDP, DeepSpeed but at its ZeRO 2/3 step with fp32
    masters, :func:`device.unpriced_framework`, and a precision DeepSpeed does not run at the
    stage, a ``*-pure`` one at ZeRO 1-3, :func:`device.unrun_precision`), ``recompute``
    (none or full), sequence parallelism and the framework, whose gradient buffers are priced
    by the traced paths' one implementation (:func:`device.grad_buffers`) for ``megatron``
    (the default, CONA's: Megatron-Core's ``main_grad`` buffer at ZeRO 0/1, one rank
    included, full size in every phase in place of the per-layer gradients) and ``pytorch``
    (beyond one rank torch DDP's gradient buckets beside them); DeepSpeed's ZeRO buckets by
    the traced paths' one rule
    (:func:`device.deepspeed_buckets`, one rank included); whatever the framework, NCCL's
    buffers of each communicator the rank runs a collective on, one per parallel group of more
    than one rank (dp, tp, pp, the world group under Megatron-LM and DeepSpeed, and Megatron's
    model-parallel, gradient-statistics and embedding groups:
    :func:`device.nccl_communicators`, the traced paths' one implementation), outside the
    caching allocator. ``buffers``: the framework's bucket and NCCL buffer sizes (default: the
    documented defaults, :class:`device.CommBuffers`); ZeRO-3's prefetch bucket is DeepSpeed's
    default here (:mod:`zero`), another one is refused.
    The device: ``capacity_gib`` (a number of GiB, or a card key of :data:`overheads.CARDS`
    such as ``"141"``) and ``architecture`` (``"hopper"`` or ``"pre-hopper"``: the GPU
    generation whose CUDA context and allocator overheads apply; by default a card key's own,
    else Hopper's above 48 GiB: an A100-80GB is not Hopper, say so). ``margin`` fixes the
    relative margin at +-``margin`` (no coverage claimed); by default it is the registered
    margin of the job's family of work (:func:`model.margin_family`: ``multimodal``,
    ``text`` or ``vision``; split-conformal bounds of the residual model's out-of-family errors,
    ``predictors/models/memory_margins.json``). The verdict (:mod:`verdict`) is the
    prediction's ``judgement``."""
    cfg = Step(strategy, options, precision)
    if problem := (unmodelled_zero(options) or unrun_precision(options, precision)
                   or unpriced_framework(cfg)):
        raise ShardingError(problem)
    buffers = buffers or CommBuffers()
    if buffers.prefetch_bucket != PREFETCH_BUCKET:
        raise ShardingError(f"buffers.prefetch_bucket={buffers.prefetch_bucket:g}: the "
                            "analytical model prices DeepSpeed's default "
                            f"stage3_prefetch_bucket_size ({PREFETCH_BUCKET:g} elements, "
                            "zero.PREFETCH_BUCKET); leave it at the default or use the traced "
                            "path (predict_spec_memory)")
    if strategy.cp > 1:
        raise ShardingError(f"strategy {strategy.name}: cp={strategy.cp} is not modelled by "
                            "the memory predictor (context parallelism)")
    tp = strategy.tp
    spec = as_memory_model(model)
    stages = _pipeline_stages(spec, strategy)
    if spec.text is not None and tp > 1 and (spec.text.num_attention_heads % tp
                                                or spec.text.kv_heads % tp):
        raise ShardingError(f"tp={tp} must divide num_attention_heads="
                            f"{spec.text.num_attention_heads} and num_query_groups="
                            f"{spec.text.kv_heads}")
    if str(capacity_gib) in CARDS:
        capacity, overheads = CARDS[str(capacity_gib)]
    else:
        try:
            gib = float(capacity_gib)
        except ValueError:
            gib = math.nan
        if not 0 < gib < math.inf:  # NaN too
            raise ModelSpecError(f"capacity_gib={capacity_gib!r} must be a positive number of "
                                 f"GiB or a card ({', '.join(CARDS)})")
        capacity = int(gib * GiB)
        overheads = HOPPER if capacity > 48 * GiB else PRE_HOPPER
    if architecture is not None:
        by_name = {o.name: o for o in (HOPPER, PRE_HOPPER)}
        if architecture not in by_name:
            raise ModelSpecError(f"architecture={architecture!r}: choose one of "
                                 f"{', '.join(by_name)}")
        overheads = by_name[architecture]
    family = margin_family(spec)
    bounds = Margin.fixed(margin, family) if margin is not None else margin_for(family)
    predictions = [_predict_stage(part, cfg, overheads, capacity, bounds, inflight, stage,
                                  buffers)
                   for stage, part, inflight in stages]
    # the stage with the largest device total: its reserved peak's upper bound plus what lies
    # outside the allocator, which differs by stage (the first and last hold Megatron's
    # embedding communicator)
    return max(predictions, key=lambda p: p.device_total)


def _pipeline_stages(spec: ModelSpec, strategy: ParallelStrategy
                     ) -> list[tuple[int, ModelSpec, int]]:
    """``(stage, its part of the model, micro-batches in flight)`` for each pipeline stage
    that may hold the largest device total: of the stages alike in depth and role (a middle stage of
    an even split, say) the earliest, which under 1F1B holds ``min(pp - stage, micro-batches)``
    in flight, the most of them. One stage (pp = 1): the whole model."""
    pp = strategy.pp
    if pp == 1:
        return [(0, spec, 1)]
    if strategy.uneven:  # Megatron's --decoder-first/last-pipeline-num-layers
        if spec.text is None:
            raise ShardingError(f"strategy {strategy.name}: an uneven pipeline split needs a "
                                "text tower")
        layers = strategy.stage_layers(spec.text.num_layers)
    else:
        if spec.text is None or spec.text.num_layers % pp:
            depth = spec.text.num_layers if spec.text else 0
            raise ShardingError(f"pp={pp} must divide the text tower's num_layers={depth}")
        layers = (spec.text.num_layers // pp,) * pp
    out, seen = [], set()
    for i, n in enumerate(layers):
        role = (n, i == 0, i == pp - 1)
        if role not in seen:
            seen.add(role)
            out.append((i, spec.pipeline_stage(n, first=i == 0, last=i == pp - 1),
                        min(pp - i, strategy.num_microbatches)))
    return out


def _predict_stage(spec: ModelSpec, cfg: Step, overheads: CudaOverheads, capacity: int,
                   bounds: Margin, inflight: int, stage: int,
                   buffers: CommBuffers) -> MemoryPrediction:
    """One rank of one pipeline stage (``spec``: the stage's part of the model) holding
    ``inflight`` micro-batches' activations, with the framework's ``buffers``."""
    strategy, options = cfg.strategy, cfg.options
    tp = strategy.tp
    reserved, est = _shipped_model().predict(spec, cfg, overheads)
    fz = factorize(spec, cfg)
    grad_params = trainable_params(fz)
    tensors = trainable_tensors(fz)
    grads = grad_buffers(cfg, grad_params, cfg.precision)
    held = grads if replaces_gradients(cfg, cfg.precision) else {}
    cast = step_copy(cfg, tensors, cfg.precision)
    if held or cast:
        # Megatron's buffer (DeepSpeed's BF16_Optimizer's fp32 buffer and kept bf16 .grad)
        # holds every gradient from wrap time, one rank included: the walk holds it, full
        # size, in every phase instead of the per-layer gradients of the plain PyTorch step
        # the residual model was trained on (which appear in the backward, so none at a
        # forward or loss peak); DeepSpeed's FP16_Optimizer keeps those and adds its fp32
        # copies at the step. Priced beyond the residual by the walks' difference
        framework = walk_phases(spec, cfg, overheads, fz, grad_buffer=held, step_copy=cast)
        reserved += framework.peak_allocated - est.peak_allocated
        est = framework
    comps = dict(est.components)
    if tp > 1 or inflight > 1:
        comps = per_rank_components(comps, tp, inflight, _activation_tp_share(
            spec, tp, options.sequence_parallel))  # fmt: skip
        # the allocator's overhead over live bytes is kept in proportion
        reserved = int(reserved * sum(comps.values()) / max(sum(est.components.values()), 1))
    if options.framework == "pytorch" and strategy.dp > 1:
        # torch DDP's buckets, allocated when it wraps the model: live in every phase beside
        # the gradients, so the walk's peak grows by them; whole segments of their own (25 MiB
        # buckets); each rank buckets its 1/tp of the gradients
        ddp = {k: v // tp for k, v in grads.items()}
        comps.update(ddp)
        reserved += sum(ddp.values())
    # the 1F1B schedule's received output gradient and kept input gradient, per rank already
    # (split by tp with sequence parallelism only), live in the forward and backward
    if spec.text is not None:
        p2p = pipeline_buffers(cfg, spec.text.seq_length, spec.text.hidden_size, stage, inflight)
        comps.update(p2p)
        reserved += sum(p2p.values())
    # DeepSpeed's buckets, fixed sizes (not split by tp; ZeRO 0's flattens the rank's 1/tp of
    # each gradient): priced live at the peak whatever its phase, as the traced path prices
    # them (stage 1/2's ipg buffers live from the backward's start to its end, ZeRO 0's after
    # it: at another peak this is an upper bound); whole segments of their own
    ds = deepspeed_buckets(cfg, comps["parameters"], cfg.precision, buffers,
                           [n // tp for n in tensors])
    comps.update(ds)
    reserved += sum(ds.values())
    return MemoryPrediction(spec, cfg, reserved, sum(comps.values()), est.peak_phase,
                            comps, overheads.context_bytes, capacity, bounds,
                            _shipped_model().trained_on, inflight,
                            nccl_communicators(strategy, options, buffers,
                                               embedding_stage=_embedding_stage(spec)), stage)


def _embedding_stage(spec: ModelSpec) -> bool:
    """Whether a pipeline stage (``spec``: its part of the model) holds a copy of tied word
    embeddings: the first stage's input embedding, the last's output layer
    (:func:`device.nccl_communicators`' embedding group)."""
    t = spec.text
    return t is not None and t.tied_embeddings and (t.holds_embedding or t.holds_head)


SHARDED_BY_TP = ("parameters", "gradients", "optimizer_states", "transient",
                 "megatron_grad_buffer", "ds_fp32_grad_buffer", "ds_bf16_grads")


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


def _activation_tp_share(spec: ModelSpec, tp: int, sp: bool) -> float:
    """Fraction of a layer's activations one TP rank keeps (Korthikanti et al. 2022)."""
    if tp == 1:
        return 1.0
    t = spec.text
    if t is None:
        return 1.0 / tp
    # flash attention keeps no s x s scores: the 5as/h term is absent
    heads = t.num_attention_heads
    scores = 0.0 if spec.attention == "flash" else 5 * heads * t.seq_length / t.hidden_size
    full = 34 + scores
    return 1 / tp if sp else (10 + 24 / tp + scores / tp) / full
