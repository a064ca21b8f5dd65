"""Real training curves of the TTP evaluation, cached with their provenance.

A :class:`Curve` is one real training run of a small megatron-core model on the CPU ranks: a
fixed global batch (or Megatron's ramp-up schedule) at one learning rate, validated every
``interval`` samples, with every iteration's gradient statistics (the squared norms the noise
scale is estimated from). Every curve of a case starts from the same initial weights and reads
the same sample sequence (sample ``i`` is window ``perm[i]`` of the corpus, whatever the batch).

Curves are cached by a key that hashes their provenance: the source of every file that shapes
the training (:data:`CODE_FILES`), the engine versions, the model, seed, schedule, batch and LR.
Changing any of them (a code edit included) misses the cache; ``--fresh`` recomputes all, and
every run re-trains one cached curve and requires it to match bit for bit.
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
ROOT = Path(__file__).resolve().parents[2]
# every file whose code shapes a curve (training, data, gradient statistics, this module)
CODE_FILES = ("megatron_cona/runtime/*.py", "megatron_cona/data.py", "megatron_cona/parallel.py",
              "megatron_cona/grad_probe.py", "megatron_cona/gns.py", "megatron_cona/lr_scaling.py",
              "megatron_cona/reshard/*.py", "megatron_cona/ttp/curves.py", "megatron_cpu/*.py")


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

    return {"python": platform.python_version(), "torch": torch.__version__,
            "megatron-core": version("megatron-core"), "numpy": version("numpy")}


def provenance(*, code: str, engines: dict, model: TransformerSpec, seed: int, schedule: dict,
               batch: int, lr: float, ramp: dict | None = None, ranks: int) -> dict:
    """Everything a curve depends on; its hash is the cache key."""
    return {"code": code, "engines": engines, "model": asdict(model), "seed": seed,
            "schedule": schedule, "batch": batch, "lr": lr, "ramp": ramp, "ranks": ranks}


def cache_key(prov: dict) -> str:
    return hashlib.sha256(json.dumps(prov, sort_keys=True, default=str).encode()).hexdigest()[:20]


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
        if data.get("provenance") != json.loads(json.dumps(prov, default=str)):
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


def megatron_rampup(start: int, increment: int, ramp_samples: int, final: int
                    ) -> Callable[[int], int]:
    """Megatron's ``--rampup-batch-size START INCREMENT SAMPLES`` with ``--global-batch-size
    FINAL``: the global batch after ``consumed`` samples, from megatron-core's own
    ``RampupBatchsizeNumMicroBatchesCalculator``."""
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )

    if start <= 0 or increment <= 0 or final < start or (final - start) % increment:
        raise CurveError(f"rampup: start={start} increment={increment} final={final}: need "
                         "0 < start <= final and (final - start) divisible by increment")
    calc = RampupBatchsizeNumMicroBatchesCalculator(final, 1, 1, False, 0, start, increment,
                                                    ramp_samples)

    def batch(consumed: int) -> int:
        calc.update(consumed, consistency_check=True)
        return calc.get_current_global_batch_size()
    return batch


def train_curve(trainer: Trainer, prov: dict, lr_rule: BatchLR, interval: int,
                max_samples: int, stop_loss: float | None = None,
                progress: Callable[[int, float], None] = lambda s, v: None) -> Curve:
    """Train from the initial weights at ``prov['batch']`` (or its ramp), validating every
    ``interval`` samples, until one interval after ``stop_loss`` is reached, or
    ``max_samples`` (collective)."""
    ramp = prov.get("ramp")
    schedule = (megatron_rampup(ramp["start"], ramp["increment"], ramp["samples"], prov["batch"])
                if ramp else (lambda consumed: prov["batch"]))
    t0 = time.perf_counter()
    curve = Curve(cache_key(prov), prov)
    batch = schedule(0)
    trainer.start(lr_rule.base_lr, batch)
    trainer.set_batch(batch, lr_rule.scale(batch))
    samples, next_eval = 0, interval
    curve.samples.append(0)
    curve.val_loss.append(trainer.val_loss())
    curve.train_loss.append(math.nan)
    losses, stats = [], []
    try:
        while samples < max_samples:
            want = schedule(samples)
            if want != batch:
                batch = want
                trainer.set_batch(batch, lr_rule.scale(batch))
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
            # one interval past the first point at the target: a chain that enters this curve
            # anywhere above the target can still train a whole interval on it
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
