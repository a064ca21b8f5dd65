"""The simulated cluster clock of the law-based simulation (GPT-3 1.3B on 8x A100 as vTrain
measured it), and the time predictor CONA ranks with there -- kept independent of each other.

* Iteration time: the measured Megatron iteration time of the target model on 8x A100 from
  vTrain (``ground_truth_single.csv``, MIT) for that (DP, TP, PP, micro, global batch). A global
  batch vTrain did not measure for a measured (DP, TP, PP, micro) is charged by the least-squares
  line through that layout's measured times over the number of micro-batches (iteration time is
  affine in it), between the smallest and largest measured batch only; nothing else is ever
  charged, and no predictor is involved.
* Switch cost: a batch-only switch costs what the CONA runtime's batch switch measured on this
  machine. A layout switch costs the measured fixed part of a real in-memory layout switch of the
  CONA runtime (build + plan + finalize phases, measured here) plus the bytes the reshard planner
  moves for the target model between the two layouts (fp16 weights, fp32 main weights, two Adam
  moments), for the busiest rank, over the target GPU's intra-node (NVLink) bandwidth.
* CONA's predictor (:class:`HeldOutPredictor`): the predictors' LightGBM time model trained on
  vTrain with the WHOLE model-size group the clock charges (hidden 2048 x 24 layers, every GPU
  count) held out, so CONA never saw a row the clock charges.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from megatron_cona.parallel import coord_of
from megatron_cona.reshard.boxes import full_box, intersect, volume
from megatron_cona.reshard.plan import SegmentMeta, build_plan
from predictors.datasets.vtrain import GPT2_VOCAB, VTRAIN_DEVICE, VTRAIN_PRECISION, load_vtrain
from predictors.spec import ParallelStrategy, TransformerSpec

# GPT-3 1.3B as vTrain measured it (its rows use the GPT-2 vocabulary and Megatron-DeepSpeed's
# unfused core attention, as predictors.datasets.vtrain traces them)
GPT_1_3B = TransformerSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                           seq_length=1024, vocab_size=GPT2_VOCAB, attention="unfused")
Layout = tuple[int, int, int]


class ClockError(ValueError):
    """The clock cannot charge a strategy (names it)."""


class VTrainTimes:
    """vTrain's measured iteration times of one model on one GPU count."""

    def __init__(self, model: TransformerSpec, gpus: int, rows=None) -> None:
        self.model, self.gpus = model, gpus
        self.table: dict[ParallelStrategy, float] = {}
        for r in rows if rows is not None else load_vtrain():
            if (r.strategy.world_size == gpus and r.spec.hidden_size == model.hidden_size
                    and r.spec.num_layers == model.num_layers
                    and r.spec.num_attention_heads == model.num_attention_heads
                    and r.spec.seq_length == model.seq_length):
                self.table[r.strategy] = r.seconds
        if not self.table:
            raise ClockError(f"vTrain has no rows for {model} on {gpus} GPUs")
        self._lines: dict[tuple[int, int, int, int], tuple[float, float, int, int] | None] = {}

    def lookup(self, s: ParallelStrategy) -> float | None:
        """The measured time of exactly ``s`` (None: not measured)."""
        return self.table.get(s)

    def line(self, s: ParallelStrategy) -> tuple[float, float] | None:
        """(intercept, slope per micro-batch) of this layout + micro-batch when >= 2 global
        batches were measured AND ``s`` lies between them (interpolation only: a line
        extrapolated below the measured range undercuts every measured time)."""
        key = (s.dp, s.tp, s.pp, s.micro_batch)
        if key not in self._lines:
            pts = [(m.num_microbatches, t) for m, t in self.table.items()
                   if (m.dp, m.tp, m.pp, m.micro_batch) == key]
            if len(pts) < 2:
                self._lines[key] = None
            else:
                n = len(pts)
                mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
                sxx = sum((x - mx) ** 2 for x, _ in pts)
                slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
                self._lines[key] = (my - slope * mx, slope, min(x for x, _ in pts),
                                    max(x for x, _ in pts))
        line = self._lines[key]
        if line is None or not line[2] <= s.num_microbatches <= line[3]:
            return None
        return line[0], line[1]


@dataclass
class SimulatedClock:
    """Charges iterations and switches (see module doc)."""

    measured: VTrainTimes  # or any object with model, gpus, lookup(s) and line(s)
    fixed_switch_s: float  # measured: build + plan + finalize of a real layout switch
    batch_switch_s: float  # measured: a real batch-only switch
    link_bytes_per_s: float  # per-GPU intra-node bandwidth of the target (NVLink)
    bytes_per_param: int = 2 + 4 + 4 + 4  # fp16 weight, fp32 main weight, Adam m and v
    exact: int = 0
    interpolated: int = 0
    plan_ranks: int = 64  # beyond this many GPUs, receive-side bytes (see moved_bytes)
    _bytes: dict[tuple[Layout, Layout], int] = field(default_factory=dict, repr=False)

    def iteration_time(self, s: ParallelStrategy) -> float:
        seconds = self.measured.lookup(s)
        if seconds is not None:
            self.exact += 1
            return seconds
        line = self.measured.line(s)
        if line is None:
            raise ClockError(f"strategy {s.name}: vTrain measured no iteration time for layout "
                             f"dp{s.dp}tp{s.tp}pp{s.pp} with micro-batch {s.micro_batch} "
                             "at >= 2 global batches around this one")
        self.interpolated += 1
        return line[0] + line[1] * s.num_microbatches

    def has_time(self, s: ParallelStrategy) -> bool:
        return self.measured.lookup(s) is not None or self.measured.line(s) is not None

    def moved_bytes(self, old: Layout, new: Layout) -> int:
        """Bytes the busiest rank sends or receives when the reshard planner moves the target
        model's training state from layout ``old`` to ``new``. Beyond ``plan_ranks`` GPUs the
        full plan is too slow to build for every pair (~10 s each at 512): the busiest rank's
        bytes to RECEIVE instead (its new shard minus what it already holds, one rank per
        (TP, PP) coordinate pair) -- what it must get whatever the plan; the sends, which the
        planner spreads over the DP replicas holding a piece, are not counted (within 10% of the
        plan's busiest rank on 8 GPUs, 0.6% on 64: tests/cona/test_lawsim.py)."""
        if (old, new) not in self._bytes and self.measured.gpus > self.plan_ranks:
            self._bytes[(old, new)] = self._received_bytes(old, new)
        if (old, new) not in self._bytes:
            model, world = self.measured.model, self.measured.gpus
            src = [model_segments(model, ParallelStrategy(*old), r, self.bytes_per_param)
                   for r in range(world)]
            dst = [model_segments(model, ParallelStrategy(*new), r, self.bytes_per_param)
                   for r in range(world)]
            plan = build_plan(src, dst, bucket_bytes=1 << 62)
            load: dict[int, list[int]] = defaultdict(lambda: [0, 0])
            for bucket in plan.buckets:
                for op in bucket:
                    if not op.is_local:
                        load[op.src_rank][0] += op.nbytes
                        load[op.dst_rank][1] += op.nbytes
            self._bytes[(old, new)] = max((max(v) for v in load.values()), default=0)
        return self._bytes[(old, new)]

    def _received_bytes(self, old: Layout, new: Layout) -> int:
        model = self.measured.model
        a, b = ParallelStrategy(*old), ParallelStrategy(*new)
        seen: dict[tuple[int, int, int, int], int] = {}
        for rank in range(self.measured.gpus):
            ca, cb = coord_of(a, rank), coord_of(b, rank)
            key = (ca.tp, ca.pp, cb.tp, cb.pp)
            if key in seen:
                continue
            held = {m.key: m.box for m in model_segments(model, a, rank, self.bytes_per_param)}
            need = 0
            for m in model_segments(model, b, rank, self.bytes_per_param):
                have = intersect(m.box, held[m.key]) if m.key in held else None
                need += m.nbytes - (volume(have) * m.itemsize if have else 0)
            seen[key] = need
        return max(seen.values(), default=0)

    def switch_time(self, old: ParallelStrategy, new: ParallelStrategy) -> float:
        if old == new:
            return 0.0
        if old.layout == new.layout:
            return self.batch_switch_s
        return self.fixed_switch_s + self.moved_bytes(old.layout, new.layout) / self.link_bytes_per_s


def model_segments(model: TransformerSpec, strategy: ParallelStrategy, rank: int,
                   bytes_per_param: int) -> list[SegmentMeta]:
    """What one rank holds of a megatron GPT (local layer spec, tied embeddings, non-distributed
    optimizer) in ``strategy``, as boxes of global tensors -- the planner's input, built from the
    model's shapes instead of a live model (the target model does not fit this machine)."""
    c = coord_of(strategy, rank)
    tp = strategy.tp
    h, ffn = model.hidden_size, model.ffn
    vocab = math.ceil(model.vocab_size / (128 * strategy.world_size)) * 128 * strategy.world_size
    per_stage = model.num_layers // strategy.pp
    params: list[tuple[str, tuple[int, ...], int | None]] = []  # name, global shape, TP dim
    if c.pp == 0 or c.pp == strategy.pp - 1:  # first stage: embedding; last: its tied copy
        params.append(("embedding.word_embeddings.weight", (vocab, h), 0))
    if c.pp == 0:
        params.append(("embedding.position_embeddings.weight", (model.seq_length, h), None))
    for layer in range(c.pp * per_stage, (c.pp + 1) * per_stage):
        p = f"decoder.layers.{layer}."
        params += [(p + "input_layernorm.weight", (h,), None),
                   (p + "input_layernorm.bias", (h,), None),
                   (p + "self_attention.linear_qkv.weight", (3 * h, h), 0),
                   (p + "self_attention.linear_qkv.bias", (3 * h,), 0),
                   (p + "self_attention.linear_proj.weight", (h, h), 1),
                   (p + "self_attention.linear_proj.bias", (h,), None),
                   (p + "pre_mlp_layernorm.weight", (h,), None),
                   (p + "pre_mlp_layernorm.bias", (h,), None),
                   (p + "mlp.linear_fc1.weight", (ffn, h), 0),
                   (p + "mlp.linear_fc1.bias", (ffn,), 0),
                   (p + "mlp.linear_fc2.weight", (h, ffn), 1),
                   (p + "mlp.linear_fc2.bias", (h,), None)]
    if c.pp == strategy.pp - 1:
        params += [("decoder.final_layernorm.weight", (h,), None),
                   ("decoder.final_layernorm.bias", (h,), None)]
    out = []
    for name, shape, dim in params:
        box = full_box(shape)
        if dim is not None and tp > 1:
            piece = shape[dim] // tp
            box = tuple((c.tp * piece, (c.tp + 1) * piece) if d == dim else r
                        for d, r in enumerate(box))
        out.append(SegmentMeta(name, shape, box, bytes_per_param))
    return out


class TableThroughput:
    """Iteration times from a precomputed table (what rank 0's predictor said, broadcast)."""

    def __init__(self, table: dict[ParallelStrategy, float]) -> None:
        self.table = table

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        return self.table[strategy]


@dataclass
class HeldOutPredictor:
    """The predictors' LightGBM time model trained without the clock's model-size group."""

    model: TransformerSpec
    held_out_group: str
    train_rows: int
    held_out_mape: float  # on the held-out group's 8-GPU rows (the ones the clock charges)
    _time_model: object = field(repr=False)

    @classmethod
    def train(cls, model: TransformerSpec, gpus: int) -> HeldOutPredictor:
        """By the predictors' one trainer of the held-out vTrain model
        (:func:`predictors.time.train.train_vtrain_model`: host constants fitted on the kept rows)."""
        from predictors.time.model import mape
        from predictors.time.predictor import predict_with_model
        from predictors.time.train import train_vtrain_model

        rows = load_vtrain()
        group = f"h{model.hidden_size}-l{model.num_layers}"
        test = [r for r in rows if r.size == group and r.strategy.world_size == gpus]
        if not test:
            raise ClockError(f"vTrain has no rows of model-size group {group} to hold out")
        tm = train_vtrain_model(lambda r: r.size == group, rows=rows)
        pred = [predict_with_model(tm, r.spec, r.strategy, VTRAIN_PRECISION, VTRAIN_DEVICE)
                for r in test]  # fmt: skip
        return cls(model, group, len(rows) - tm.meta["excluded_rows"],
                   mape(pred, [r.seconds for r in test]), tm)  # fmt: skip

    def iteration_time(self, strategy: ParallelStrategy) -> float:
        from predictors.time.predictor import predict_with_model

        return predict_with_model(self._time_model, self.model, strategy, VTRAIN_PRECISION,
                                  VTRAIN_DEVICE)  # fmt: skip
