"""How a job is split over GPUs: DP x TP x PP x CP degrees and the micro-/global-batch sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .model import TransformerSpec


class StrategyError(ValueError):
    """A strategy that does not fit the world size, the model or the batch sizes."""


@dataclass(frozen=True)
class ParallelStrategy:
    """DP x TP x PP (x CP) degrees plus micro- and global-batch sizes (in sequences).

    ``cp`` is context parallelism (Megatron ``--context-parallel-size``, torchtitan
    ``context_parallel_degree``): each of ``cp`` ranks holds ``seq_length / cp`` tokens of every
    sequence and attends to all of them (ring attention); the ranks of a CP group share the
    data-parallel batch, and gradients are reduced over DP x CP.

    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's uneven pipeline split
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``): the first
    or last stage holds that many layers and the stages between share the rest evenly (e.g. 126
    layers on pp=8 as 15 + 6 x 16 + 15), so a depth that pp does not divide still runs."""

    dp: int
    tp: int
    pp: int
    micro_batch: int = 1
    global_batch: int | None = None  # None: dp * micro_batch (one micro-batch per step)
    cp: int = 1
    first_stage_layers: int | None = None  # None: the even split
    last_stage_layers: int | None = None

    _NAME = re.compile(r"^dp(\d+)tp(\d+)pp(\d+)(?:cp(\d+))?(?:mb(\d+))?(?:gb(\d+))?"
                       r"(?:first(\d+))?(?:last(\d+))?$")

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp", "cp", "micro_batch"):
            if getattr(self, field) < 1:
                raise StrategyError(f"{field}={getattr(self, field)} must be >= 1")
        if self.global_batch is not None and self.global_batch % (self.dp * self.micro_batch):
            raise StrategyError(
                f"global_batch={self.global_batch} is not divisible by dp*micro_batch="
                f"{self.dp * self.micro_batch}"
            )
        for field in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, field)
            if value is not None and (value < 1 or self.pp == 1):
                raise StrategyError(f"{field}={value} needs pp > 1 and >= 1 layer "
                                    f"(pp={self.pp})")
        if (self.pp == 2 and self.first_stage_layers is not None
                and self.last_stage_layers is not None):
            raise StrategyError("first_stage_layers and last_stage_layers on pp=2 leave no "
                                "stage between them; give one of the two")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.global_batch if self.global_batch is not None else self.dp * self.micro_batch

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch)

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.pp)

    @property
    def name(self) -> str:
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        first = f"first{self.first_stage_layers}" if self.first_stage_layers is not None else ""
        last = f"last{self.last_stage_layers}" if self.last_stage_layers is not None else ""
        return (f"dp{self.dp}tp{self.tp}pp{self.pp}{cp}mb{self.micro_batch}"
                f"gb{self.global_batch_size}{first}{last}")

    @property
    def uneven(self) -> bool:
        """True where the first or last stage's depth is set (Megatron's uneven split)."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers each pipeline stage holds, first to last; raise :class:`StrategyError` naming
        the field where the split does not fit ``num_layers`` (Megatron's own rule: the stages
        between the first and last share the remaining layers evenly)."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if not self.uneven:
            if num_layers % self.pp:
                raise StrategyError(f"strategy {self.name}: pp={self.pp} does not divide "
                                    f"num_layers={num_layers} (an uneven split names its end "
                                    "stages' layers: first<F>last<L>, Megatron's "
                                    "--decoder-first/last-pipeline-num-layers)")
            return (num_layers // self.pp,) * self.pp
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < middle_stages or (middle_stages and rest % middle_stages) or (
                not middle_stages and rest):
            raise StrategyError(
                f"strategy {self.name}: first_stage_layers={first} and last_stage_layers={last} "
                f"leave {rest} of num_layers={num_layers} layers, which the {middle_stages} "
                "stages between do not share evenly")
        each = rest // middle_stages if middle_stages else 0
        stages = [each] * self.pp
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        return tuple(stages)

    def max_stage_layers(self, num_layers: int) -> int:
        """The deepest stage's layer count: the pipeline's bottleneck sets its pace."""
        return max(self.stage_layers(num_layers))

    def with_batch(self, micro_batch: int, global_batch: int) -> ParallelStrategy:
        return replace(self, micro_batch=micro_batch, global_batch=global_batch)

    @classmethod
    def parse(cls, text: str) -> ParallelStrategy:
        """Parse ``dp2tp2pp1`` (optionally ``...cp2mb2gb16first7last7``)."""
        m = cls._NAME.match(text.strip().lower())
        if not m:
            raise StrategyError(
                f"strategy {text!r} is not of the form dp<D>tp<T>pp<P>[cp<C>][mb<M>][gb<G>]"
                "[first<F>][last<L>]")
        dp, tp, pp, cp, mb, gb, first, last = m.groups()
        return cls(int(dp), int(tp), int(pp), int(mb or 1), int(gb) if gb else None, int(cp or 1),
                   int(first) if first else None, int(last) if last else None)

    def check(self, world_size: int, model: TransformerSpec | None = None) -> None:
        """Raise :class:`StrategyError` naming the field when this strategy cannot run."""
        if self.world_size != world_size:
            raise StrategyError(
                f"strategy {self.name}: dp*tp*pp*cp={self.world_size} != world_size={world_size}"
            )
        if model is None:
            return
        if model.num_attention_heads % self.tp or model.hidden_size % self.tp:
            raise StrategyError(
                f"strategy {self.name}: tp={self.tp} does not divide num_attention_heads="
                f"{model.num_attention_heads} and hidden_size={model.hidden_size}"
            )
        if model.kv_heads % self.tp:
            raise StrategyError(
                f"strategy {self.name}: tp={self.tp} does not divide num_query_groups={model.kv_heads}"
            )
        # ring attention splits each sequence into 2*cp chunks (two per rank, balancing the
        # causal mask's work), so 2*cp must divide it
        if self.cp > 1 and model.seq_length % (2 * self.cp):
            raise StrategyError(
                f"strategy {self.name}: cp={self.cp} needs 2*cp dividing seq_length="
                f"{model.seq_length}"
            )
        if self.cp > 1 and model.attention != "flash":
            raise StrategyError(
                f"strategy {self.name}: cp={self.cp} needs attention='flash' (ring attention "
                f"runs on fused attention kernels), not {model.attention!r}"
            )
        self.stage_layers(model.num_layers)
