"""The cases of the law-based simulation: model families (their papers' recipes), clocks per
GPU count, candidates (memory-feasible), decision boundaries and targets.

* GPT-3 1.3B on 8 GPUs runs on vTrain's measured 8x A100 iteration times (sequence 1,024: the
  clock vTrain measured). Every other (family, GPU count) runs on the project's
  time predictor for A100-80GB -- labelled ``predicted clock`` everywhere -- and there CONA's time
  model is that same predictor (it ranks with the clock's own numbers).
* Candidates: (DP, TP <= 8, PP) layouts x micro-batches x power-of-two global batches, minus
  those the memory predictor says do not fit 80 GB; on the predicted clock only the layouts
  that are fastest at some global batch are kept (plus the all-DP layout Pollux uses), so that
  the exact bound stays tractable -- every chain chooses from that same set.
* Switch cost: the reshard planner's bytes for the busiest rank over the GPU's link bandwidth
  (NVLink within a node, InfiniBand across nodes) plus the measured fixed part of a real
  in-memory layout switch (:class:`~megatron_cona.lawsim.clock.SimulatedClock`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_cona.lawsim.clock import SimulatedClock
from megatron_cona.lawsim.constants import value
from megatron_cona.lawsim.law import (
    CriticalBatch,
    LawError,
    ModelLaw,
    kaplan_bcrit,
    kaplan_loss,
    make_law,
)
from megatron_cona.policy import PolicyConfig
from predictors.spec import ParallelStrategy, TransformerSpec

PREDICTED = "predicted clock (project time predictor, A100-80GB)"
MEASURED = "vTrain measured clock (8x A100)"


def nonembedding_params(spec: TransformerSpec) -> float:
    """Kaplan's N: parameters without the embeddings."""
    emb = spec.vocab_size * spec.hidden_size * (1 if spec.tied_embeddings else 2)
    return spec.num_parameters() - emb - spec.seq_length * spec.hidden_size


@dataclass(frozen=True)
class Family:
    name: str
    spec: TransformerSpec  # at its paper's sequence length
    paper_batch_tokens: float
    precision: str
    law: Callable[[TransformerSpec], ModelLaw]
    doc: str


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def _gpt_law(spec: TransformerSpec) -> ModelLaw:
    return ModelLaw("kaplan", nonembedding_params(spec), value("B_star"))


def _bert_law(spec: TransformerSpec) -> ModelLaw:
    """B* such that B_crit equals RoBERTa's best batch at that run's state (at B = B_crit a run
    takes 2 S_min steps, McCandlish Eq 2.11), and the loss scale from its perplexity."""
    n_base = value("bert_base_nonembedding_params")
    s_min = value("roberta_steps") / 2.0
    loss = kaplan_loss(n_base, s_min)
    batch = value("roberta_best_batch_seqs") * value("bert_seq")
    b_star = batch * loss ** (1.0 / value("alpha_B"))
    return ModelLaw("bert-mlm", nonembedding_params(spec), b_star,
                    loss_scale=math.log(value("roberta_ppl")) / loss)


# each family at the precision Megatron runs it with: --fp16 / --bf16 are fp16-mixed /
# bf16-mixed here (half-precision weights, fp32 main gradients and master copy); plain "fp16" /
# "bf16" are torch autocast over fp32 weights, which no Megatron job runs (the memory filter and
# the time predictor price the two apart)
register_family(Family(
    "gpt3-1.3b", TransformerSpec("gpt", 24, 2048, 16, int(value("gpt3_seq")), 50257),
    value("gpt3_1p3b_batch_tokens"), "fp16-mixed", _gpt_law,
    "GPT-3 XL (Brown et al. 2020, Table 2.1); Kaplan's constants"))
register_family(Family(
    "bert-large", TransformerSpec("bert", 24, 1024, 16, int(value("bert_seq")), 30522),
    value("bert_batch_seqs") * value("bert_seq"), "fp16-mixed", _bert_law,
    "BERT-Large (Devlin et al. 2019); B* and loss scale from RoBERTa Table 3 (MLM family)"))
register_family(Family(
    "llama-3.2-1b", TransformerSpec("llama", 16, 2048, 32, int(value("llama3_seq")), 128256,
                                    ffn_hidden_size=8192, num_query_groups=8, swiglu=True),
    value("llama3_batch_tokens"), "bf16-mixed", _gpt_law,
    "Llama-3.2-1B; batch and sequence of Llama 3's recipe (Dubey et al. 2024); Kaplan's "
    "constants (its 128k tokenizer is not corrected for)"))


class PredictedTimes:
    """The time predictor as the clock's iteration times (cached); ``line`` is the predictor's
    own two-point line over the number of micro-batches (Pollux splits iteration time with it)."""

    def __init__(self, model: TransformerSpec, gpus: int, precision: str, device: str) -> None:
        from megatron_cona.goodput import PredictorThroughput

        self.model, self.gpus = model, gpus
        self._predictor = PredictorThroughput(model, precision, device)
        self._cache: dict[ParallelStrategy, float] = {}

    def lookup(self, s: ParallelStrategy) -> float:
        if s not in self._cache:
            self._cache[s] = self._predictor.iteration_time(s)
        return self._cache[s]

    def iteration_time(self, s: ParallelStrategy) -> float:
        return self.lookup(s)

    def line(self, s: ParallelStrategy) -> tuple[float, float]:
        one = self.lookup(ParallelStrategy(*s.layout, s.micro_batch, s.dp * s.micro_batch))
        two = self.lookup(ParallelStrategy(*s.layout, s.micro_batch, 2 * s.dp * s.micro_batch))
        return 2 * one - two, two - one


@dataclass
class SimCase:
    """Everything a chain of one case may use (the same for every chain); ``dynamics`` is the
    simulator's private state law -- chains see only the probe's readings and the clock."""

    tag: str
    family: Family
    gpus: int
    variant: str
    law: ModelLaw
    dynamics: CriticalBatch
    clock: SimulatedClock
    clock_label: str
    candidates: list[ParallelStrategy]
    predicted: Callable[[ParallelStrategy], float]  # CONA's time model
    paper_batch: int  # sequences: the planner's batch
    boundaries: list[float]  # decision points, tokens
    goals: dict[str, float]  # target name -> S_min
    policy: PolicyConfig
    noise_z: float = 1.0
    seed: int = 0
    bound_snap: float = 0.0
    exact_bound: bool = False  # the exact DP beside the relaxation (slow at scale)
    rejected: int = 0
    prediction_error: float = 0.0  # held-out relative error of CONA's time model (``predicted``)
    probe_bias: float = 1.0  # the probe reads B_crit / probe_bias (the variant's k)
    extra: dict = field(default_factory=dict)

    @property
    def seq(self) -> int:
        """The sequence length of the model the clock times."""
        return self.clock.measured.model.seq_length

    def fastest(self, batch: int, pool: list[ParallelStrategy] | None = None
                ) -> ParallelStrategy:
        options = [s for s in (pool or self.candidates) if s.global_batch_size == batch]
        if not options:
            raise LawError(f"global batch {batch}: no candidate strategy")
        return min(options, key=lambda s: (self.clock.iteration_time(s), s.name))

    @property
    def batches(self) -> list[int]:
        return sorted({s.global_batch_size for s in self.candidates})

    def loss(self, s_min: float) -> float:
        return self.law.loss_scale * self.law.loss(s_min)


def boundaries(first_tokens: float, growth: float, end_tokens: float) -> list[float]:
    """Decision points: every ``first_tokens`` at first, then every ``growth`` x tokens seen
    (the same for every chain and the bound)."""
    if not first_tokens > 0 or not growth > 0:
        raise LawError(f"first_tokens={first_tokens}, growth={growth} must be > 0")
    out = [0.0]
    while out[-1] < end_tokens:
        out.append(out[-1] + max(first_tokens, growth * out[-1]))
    return out


def targets(dynamics: CriticalBatch, law: ModelLaw, batch_tokens: float, params: float
            ) -> dict[str, float]:
    """The planner's S_min at 20 tokens per parameter (Hoffmann et al. 2022) and a tenth of it."""
    far = value("tokens_per_param") * params
    return {"chinchilla/10": dynamics.advance(law.s0, 0.0, batch_tokens, far / 10),
            "chinchilla": dynamics.advance(law.s0, 0.0, batch_tokens, far)}


def data_anchor(batch_tokens: float, params: float) -> Callable[[CriticalBatch],
                                                                  tuple[float, float]]:
    """Where the D^0.47 variant meets Kaplan's: the paper's batch at compute-optimal data."""
    def anchor(kaplan: CriticalBatch) -> tuple[float, float]:
        far = value("tokens_per_param") * params
        s = kaplan.advance(kaplan.law.s0, 0.0, batch_tokens, far)
        return far, kaplan_bcrit(kaplan.law.loss(s), kaplan.b_star)
    return anchor


def dynamics_for(variant: str, law: ModelLaw, batch_tokens: float, params: float
                 ) -> CriticalBatch:
    return make_law(variant, law, data_anchor(batch_tokens, params))
