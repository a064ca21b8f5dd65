"""Real training curves on the CPU ranks, kept with their provenance (benchmark support: the
law check of ``cona_law_check.py``; never imported by the plugin).

A :class:`Curve` is one real training run of a small megatron-core model through the CONA
runtime: a fixed global batch at one learning rate, validated every ``interval`` samples, with
every iteration's gradient statistics (the squared norms the noise scale is estimated from).
Every curve of one seed starts from the same initial weights and reads the same sample sequence
(sample ``i`` is window ``perm[i]`` of the corpus, whatever the batch).

A curve is stored under a key hashing what it is an experiment OF (model, seed, schedule,
batch, LR, ranks); its provenance also records what produced it (the hash of every file that
shapes training, :data:`CODE_FILES`, and the engine versions). The key leaves those two out on
purpose: committed curves stay findable after an unrelated edit, and whether today's code and
engines still produce them is decided by re-training one bit for bit on every run
(:meth:`Curve.same_numbers`), never assumed.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_cona.gns import GradStats
from megatron_cona.lr_scaling import BatchLR
from predictors.spec import ParallelStrategy, TransformerSpec

EXEC_MAX_MICRO = 16
ROOT = Path(__file__).resolve().parents[1]
# every file whose code shapes a curve (training, data, gradient statistics, this module)
CODE_FILES = ("megatron_cona/runtime/*.py", "megatron_cona/data.py", "megatron_cona/parallel.py",
              "megatron_cona/grad_probe.py", "megatron_cona/gns.py", "megatron_cona/lr_scaling.py",
              "megatron_cona/reshard/*.py", "benchmarks/cona_curves.py", "megatron_cpu/*.py")


class CurveError(ValueError):
    """A curve that cannot be trained or read (names the field)."""


def exec_strategy(global_batch: int, ranks: int, max_micro: int = EXEC_MAX_MICRO
                  ) -> ParallelStrategy:
    """How a global batch runs on the CPU ranks: data parallel, the largest power-of-two
    micro-batch (<= ``max_micro``) dividing the local batch; with one rank at least two
    micro-batches, so the first micro-batch gives the small-batch gradient norm."""
    if global_batch % ranks:
        raise CurveError(f"global batch {global_batch} is not divisible by ranks={ranks}")
    local = global_batch // ranks
    limit = min(max_micro, local // 2) if ranks == 1 else max_micro
    micro = 1
    while micro * 2 <= limit and local % (micro * 2) == 0:
        micro *= 2
    return ParallelStrategy(ranks, 1, 1, micro, global_batch)


@dataclass(frozen=True)
class TrainerConfig:
    model: TransformerSpec
    seed: int
    warmup_samples: int
    decay_samples: int
    min_lr_fraction: float
    val_samples: int


class Trainer:
    """The real training of one curve: the CONA runtime on the CPU ranks."""

    def __init__(self, config: TrainerConfig, corpus) -> None:
        self.config, self.corpus = config, corpus
        self.ranks = dist.get_world_size()
        self.executor = None

    def start(self, lr: float, global_batch: int) -> None:
        from megatron_cona.runtime import TrainConfig, build_state
        from megatron_cona.runtime.executor import RuntimeExecutor

        c = self.config
        cfg = TrainConfig(model=c.model, lr=lr, min_lr=lr * c.min_lr_fraction,
                          lr_warmup_samples=c.warmup_samples, lr_decay_samples=c.decay_samples,
                          lr_decay_style="cosine", adam_beta2=0.99, seed=c.seed)
        self.executor = RuntimeExecutor(build_state(cfg, exec_strategy(global_batch, self.ranks)))

    @property
    def state(self):
        return self.executor.state

    def set_batch(self, global_batch: int, lr_scale: float) -> None:
        target = exec_strategy(global_batch, self.ranks)
        if target != self.state.strategy:
            outcome = self.executor.switch(target)
            if not outcome.switched:
                raise RuntimeError(f"switch to {target.name} failed: {outcome.error}")
        self.executor.set_lr_scale(lr_scale)

    def step(self):
        from megatron_cona.runtime import train_step

        return train_step(self.state, self.corpus.train, grad_stats=True)

    def val_loss(self) -> float:
        from megatron_cona.runtime import evaluate

        return evaluate(self.state, self.corpus.valid, 0, self.config.val_samples)

    def close(self) -> None:
        self.state.destroy()
        self.executor = None


# ------------------------------------------------------------------------------ the curve


@dataclass
class Curve:
    key: str
    provenance: dict
    samples: list[int] = field(default_factory=list)  # validation points: 0, I, 2I, ...
    val_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # interval mean (nan at 0)
    # per interval, per iteration: (mean small-batch sq norm, small batch, big sq norm, big batch)
    stats: list[list[tuple[float, int, float, int]]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def batch(self) -> int:
        return self.provenance["batch"]

    @property
    def lr(self) -> float:
        return self.provenance["lr"]

    def reached(self, target: float) -> bool:
        return any(v <= target for v in self.val_loss)

    def same_numbers(self, other: Curve) -> bool:
        """Bit-exact equality of everything measured (not the wall time); NaN equals NaN, and
        float repr round-trips, so the JSON text compares every bit."""
        def text(c: Curve) -> str:
            return json.dumps([c.samples, c.val_loss, c.train_loss,
                               [[list(s) for s in it] for it in c.stats]])
        return text(self) == text(other)

    def max_rel_diff(self, other: Curve) -> dict[str, float]:
        """The largest relative difference between two curves' measured numbers, per kind:
        ``loss`` (validation and training) and ``grad_norm`` (the probe's squared norms); inf
        where their sample counts or batch sizes differ, or one number is not finite where the
        other differs (NaN against NaN is equal)."""
        def counts(c: Curve) -> str:
            return json.dumps([c.samples, [[(s[1], s[3]) for s in it] for it in c.stats]])

        def worst(a: list[float], b: list[float]) -> float:
            if len(a) != len(b):
                return math.inf
            out = 0.0
            for x, y in zip(a, b, strict=True):
                if x == y or (math.isnan(x) and math.isnan(y)):
                    continue
                if not (math.isfinite(x) and math.isfinite(y)):
                    return math.inf
                out = max(out, abs(x - y) / max(abs(x), abs(y)))
            return out

        def norms(c: Curve) -> list[float]:
            return [x for it in c.stats for s in it for x in (s[0], s[2])]

        if counts(self) != counts(other):
            return {"loss": math.inf, "grad_norm": math.inf}
        return {"loss": worst([*self.val_loss, *self.train_loss],
                              [*other.val_loss, *other.train_loss]),
                "grad_norm": worst(norms(self), norms(other))}


def code_hash(root: Path = ROOT, patterns: tuple[str, ...] = CODE_FILES) -> str:
    """sha256 over the path and bytes of every file that shapes a curve."""
    h = hashlib.sha256()
    for pattern in patterns:
        files = sorted(root.glob(pattern))
        if not files:
            raise CurveError(f"CODE_FILES: {pattern!r} matches nothing under {root}")
        for path in files:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def engine_versions() -> dict[str, str]:
    from importlib.metadata import version

    # the CPU kernels torch dispatches to (AVX2, AVX512, ...): float sums differ between them,
    # so a curve re-trains bit for bit only where they are the same
    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron-core": version("megatron-core"), "numpy": version("numpy"),
            "cpu": torch.backends.cpu.get_cpu_capability()}


def provenance(*, code: str, engines: dict, model: TransformerSpec, seed: int, schedule: dict,
               batch: int, lr: float, ranks: int) -> dict:
    """Everything a curve depends on: the experiment (hashed into its key) and the code and
    engines that produced it (recorded, checked by re-training)."""
    return {"code": code, "engines": engines, "model": asdict(model), "seed": seed,
            "schedule": schedule, "batch": batch, "lr": lr, "ranks": ranks}


PRODUCED_BY = ("code", "engines")  # recorded in the provenance, left out of the key


def cache_key(prov: dict) -> str:
    experiment = {k: v for k, v in prov.items() if k not in PRODUCED_BY}
    return hashlib.sha256(json.dumps(experiment, sort_keys=True, default=str).encode()
                          ).hexdigest()[:20]


class CurveCache:
    """One JSON file per curve, named by its key (``dir/<key>.json``)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def get(self, prov: dict) -> Curve | None:
        path = self.path(cache_key(prov))
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if cache_key(data.get("provenance", {})) != cache_key(prov):
            raise CurveError(f"curve cache {path}: provenance differs from its key's")
        data["stats"] = [[tuple(s) for s in it] for it in data["stats"]]
        return Curve(**data)

    def put(self, curve: Curve) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(curve.key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(curve), default=str))
        tmp.replace(path)  # a killed run leaves whole curves only
        return path


# ------------------------------------------------------------------------ train a curve


def train_curve(trainer: Trainer, prov: dict, lr_rule: BatchLR, interval: int,
                max_samples: int, stop_loss: float | None = None,
                progress: Callable[[int, float], None] = lambda s, v: None) -> Curve:
    """Train from the initial weights at ``prov['batch']``, validating every ``interval``
    samples, until one interval after ``stop_loss`` is reached, or ``max_samples``
    (collective)."""
    t0 = time.perf_counter()
    curve = Curve(cache_key(prov), prov)
    batch = prov["batch"]
    trainer.start(lr_rule.base_lr, batch)
    trainer.set_batch(batch, lr_rule.scale(batch))
    samples, next_eval = 0, interval
    curve.samples.append(0)
    curve.val_loss.append(trainer.val_loss())
    curve.train_loss.append(math.nan)
    losses, stats = [], []
    try:
        while samples < max_samples:
            step = trainer.step()
            if not math.isfinite(step.loss):
                raise CurveError(f"curve {prov['batch']}@{prov['lr']}: loss={step.loss} at "
                                 f"{samples} samples")
            samples += batch
            losses.append(step.loss)
            stats.append(_stat(step.grad_stats))
            if samples < next_eval:
                continue
            next_eval += interval
            curve.samples.append(samples)
            curve.val_loss.append(trainer.val_loss())
            curve.train_loss.append(sum(losses) / len(losses))
            curve.stats.append(stats)
            losses, stats = [], []
            progress(samples, curve.val_loss[-1])
            # one point past the first at the target: the crossing is bracketed
            if stop_loss is not None and sum(v <= stop_loss for v in curve.val_loss) >= 2:
                break
    finally:
        trainer.close()
    curve.wall_s = time.perf_counter() - t0
    return curve


def _stat(stats: GradStats | None) -> tuple[float, int, float, int]:
    sample = stats.sample() if stats is not None else None
    if sample is None:
        return (math.nan, 0, math.nan, 0)
    small = sum(sample.small_sq) / len(sample.small_sq)
    return (small, sample.small_batch, sample.big_sq, sample.big_batch)


# ----------------------------------------------------------------- the tiny models and ranks


def tiny_spec(family: str = "gpt", num_layers: int = 2, hidden_size: int = 64,
              num_attention_heads: int = 4, seq_length: int = 64) -> TransformerSpec:
    """The small megatron-core models CPU ranks train in minutes: GPT-style, or Llama-style
    (GQA with 2 query groups, SwiGLU, untied embeddings)."""
    from megatron_cona.data import VOCAB_SIZE

    if family == "gpt":
        return TransformerSpec("gpt", num_layers, hidden_size, num_attention_heads, seq_length,
                               VOCAB_SIZE)
    if family == "llama":
        return TransformerSpec("llama", num_layers, hidden_size, num_attention_heads,
                               seq_length, VOCAB_SIZE, num_query_groups=2, swiglu=True,
                               tied_embeddings=False)
    raise CurveError(f"family={family!r} is not 'gpt' or 'llama'")


def measure_switch_costs(repeats: int = 3) -> tuple[float, float]:
    """Median seconds of (the fixed part of a layout switch, a batch-only switch) of the real
    CONA runtime on these ranks (collective): build + plan + finalize phases, Adam state
    present as in a running job."""
    import statistics

    from megatron_cona.data import CorpusConfig, build_corpus
    from megatron_cona.runtime import TrainConfig, build_state, switch_strategy, train_step

    ranks = dist.get_world_size()
    spec = tiny_spec()
    corpus = build_corpus(CorpusConfig(seq_length=spec.seq_length))
    dp = exec_strategy(2 * ranks, ranks)
    tp = ParallelStrategy(1, ranks, 1, dp.micro_batch, dp.global_batch_size)
    state = build_state(TrainConfig(spec), dp)
    train_step(state, corpus.train)
    fixed, batch = [], []
    for _ in range(repeats):
        for target in (tp, dp):
            result = switch_strategy(state, target)
            state = result.state
            fixed.append(sum(v for k, v in result.phase_seconds.items() if k != "transfer"))
        for target in (exec_strategy(4 * ranks, ranks), dp):
            result = switch_strategy(state, target)
            state = result.state
            batch.append(result.seconds)
    state.destroy()
    box = [statistics.median(fixed), statistics.median(batch)]
    dist.broadcast_object_list(box, src=0)
    return box[0], box[1]


def switch_cost_worker(rank: int, world: int, repeats: int = 3) -> tuple[float, float]:
    return measure_switch_costs(repeats)
