"""Pollux as its users run it, through adaptdl's OWN goodput code (PyPI ``adaptdl``,
``adaptdl.goodput.GoodputFunction`` and ``fit_perf_params``), as a chain of the law-based
simulation.

Benchmark support only: the product never imports adaptdl. :func:`register_pollux` adds the
``pollux`` chain to :data:`megatron_cona.lawsim.chains.CHAINS` when adaptdl imports (the test
environment and ``make bench-env``'s venv install it).

Every interval, like adaptdl's trainer, the chain
* fits adaptdl's performance model (``fit_perf_params``) to the step times it has seen on its
  data-parallel layout: adaptdl times accumulation steps and the synchronizing optimizer step
  apart; the clock has one time per iteration, split by the slope of its measured line over the
  number of micro-batches (:func:`split_time`),
* gives ``GoodputFunction`` the gradient statistics (``GradParams(sqr=|G|^2,
  var=tr(S)/init_batch)``, adaptdl's convention: the variance at the initial batch) estimated
  from the same per-iteration norms CONA sees,
* asks ``optimize(num_nodes=1, num_replicas=DP, max_batch_size, atomic_bsz_range,
  accumulation=True)`` for the best (atomic batch, accumulation steps) and runs the candidate
  of that global batch (nearest on a log scale) with that micro-batch when it exists.
The learning rate follows the case's one LR rule, like every chain. ``accumulation=True``: with
``False`` adaptdl 0.2.11 calls ``np.int``, removed from NumPy >= 1.24.
"""

from __future__ import annotations

import math

from megatron_cona.gns import GradientNoiseScale
from megatron_cona.lawsim.chains import READINGS, Chain, Driver, register, run_chain
from predictors.devices import get_device
from predictors.spec import ParallelStrategy


def grad_params(gns: GradientNoiseScale, init_batch: int) -> tuple[float, float]:
    """(sqr, var) as adaptdl's GradParams: |G|^2 and the gradient variance at ``init_batch``
    (tr(S) / init_batch)."""
    return gns.grad_sq.value, max(gns.trace_cov.value, 0.0) / init_batch


def split_time(clock, strategy: ParallelStrategy, seconds: float) -> tuple[float, float]:
    """(accumulation step, optimizer step) seconds of one iteration, as adaptdl times them:
    the per-micro-batch slope of the clock's measured line for this layout + micro-batch is the
    accumulation step, the rest the last (synchronizing) step; without a line, an equal share."""
    n = strategy.num_microbatches
    line = clock.measured.line(strategy) if n > 1 else None
    if line is not None and 0 < line[1] and seconds - (n - 1) * line[1] > 0:
        return line[1], seconds - (n - 1) * line[1]
    return seconds / n, seconds / n


def perf_observations(seen: dict[ParallelStrategy, tuple[float, float]],
                      gpus_per_node: int = 0) -> dict:
    """fit_perf_params' arguments from the (accumulation, optimizer) step times of the
    strategies run; nodes = GPUs / ``gpus_per_node`` (0: all on one node)."""
    import numpy as np

    strategies = sorted(seen, key=lambda s: s.name)
    nodes = [max(1, -(-s.world_size // gpus_per_node)) if gpus_per_node else 1
             for s in strategies]
    return {"num_nodes": np.array(nodes, dtype=int),
            "num_replicas": np.array([s.dp for s in strategies]),
            "atomic_bsz": np.array([s.micro_batch for s in strategies]),
            "accum_step_time": np.array([seen[s][0] for s in strategies]),
            "optim_step_time": np.array([seen[s][1] for s in strategies])}


def choose(goodput_fn, candidates: list[ParallelStrategy], replicas: int, nodes: int = 1
           ) -> tuple[ParallelStrategy, dict]:
    """adaptdl's ``optimize`` -> the candidate of that global batch and micro-batch."""
    max_batch = max(s.global_batch_size for s in candidates)
    max_micro = max(s.micro_batch for s in candidates)
    goodput, atomic, accum = goodput_fn.optimize(nodes, replicas, max_batch_size=max_batch,
                                                 atomic_bsz_range=(1, max_micro),
                                                 accumulation=True)
    want = replicas * int(atomic) * (int(accum) + 1)
    batches = sorted({s.global_batch_size for s in candidates})
    gb = min(batches, key=lambda b: (abs(math.log(b / want)), b))
    pool = [s for s in candidates if s.global_batch_size == gb]
    exact = [s for s in pool if s.micro_batch == int(atomic)]
    pick = (exact or sorted(pool, key=lambda s: abs(s.micro_batch - int(atomic))))[0]
    return pick, {"goodput": float(goodput), "atomic_bsz": int(atomic),
                  "accum_steps": int(accum), "adaptdl_batch": want}


class Pollux:
    """adaptdl's side of a Pollux chain, fed by the simulation's driver: the
    step times and gradient statistics seen, adaptdl's performance fit (redone only when the
    observations change) and its choice of batch. ``gpus_per_node`` 0: one node."""

    def __init__(self, clock, candidates: list[ParallelStrategy], init_batch: int,
                 gns: GradientNoiseScale, gpus_per_node: int = 0) -> None:
        self.clock, self.candidates, self.init_batch = clock, candidates, init_batch
        self.gns, self.gpus_per_node = gns, gpus_per_node
        self.seen: dict[ParallelStrategy, tuple[float, float]] = {}
        self.choices: list[dict] = []
        self._fitted: tuple = ((), None)

    def record(self, strategy: ParallelStrategy, seconds: float, stats) -> None:
        self.seen[strategy] = split_time(self.clock, strategy, seconds)
        sample = stats.sample() if stats is not None else None
        if sample is not None:
            self.gns.observe(sample)

    def choose(self, where: dict) -> ParallelStrategy | None:
        """adaptdl's choice (None until the noise scale is ready); ``where`` goes into the
        recorded choice."""
        from adaptdl.goodput import GoodputFunction, fit_perf_params

        if not self.gns.ready:
            return None
        key = tuple(sorted((s.name, t) for s, t in self.seen.items()))
        if key != self._fitted[0]:  # same observations, same (deterministic) fit: reuse it
            self._fitted = (key, fit_perf_params(**perf_observations(self.seen,
                                                                     self.gpus_per_node)))
        fn = GoodputFunction(self._fitted[1], grad_params(self.gns, self.init_batch),
                             self.init_batch)
        dp = self.candidates[0].dp
        nodes = max(1, dp // self.gpus_per_node) if self.gpus_per_node else 1
        target, info = choose(fn, self.candidates, dp, nodes)
        self.choices.append({**where, "to": target.name, **info})
        return target


class PolluxDriver(Driver):
    """Pollux in the law-based simulation: adaptdl's calls fed the simulated probe's readings
    and the clock's times (all-DP layout, any node count)."""

    observes = True

    def __init__(self, case, candidates: list[ParallelStrategy], init_batch: int,
                 gpus_per_node: int) -> None:
        self.pollux = Pollux(case.clock, candidates, init_batch,
                             GradientNoiseScale(0.5 ** (1 / READINGS)), gpus_per_node)

    def observe(self, seconds, stats, iterations, loss) -> None:
        self.pollux.record(self.executor.strategy, seconds, stats)

    def at_boundary(self, tokens: float) -> None:
        target = self.pollux.choose({"tokens": tokens})
        if target is not None and target != self.executor.strategy:
            self.executor.switch(target)


def run_pollux(case) -> list:
    """Pollux on the all-DP layout from its smallest feasible batch (adaptdl's initial batch,
    the floor ``optimize`` never goes below)."""
    pool = [s for s in case.candidates if s.layout == (case.gpus, 1, 1)]
    if not pool:
        return []
    init = min(s.global_batch_size for s in pool)
    start = case.fastest(init, pool)
    driver = PolluxDriver(case, pool, init, get_device(case.extra.get("device", "a100-80gb"))
                             .devices_per_node)
    result = run_chain(case, "pollux", {"start": start.name, "init_batch_size": init}, start,
                       driver)
    result.settings["adaptdl_choices"] = driver.pollux.choices[-20:]
    return [result]


def register_pollux() -> str:
    """Register the ``pollux`` chain of the law simulation when adaptdl imports; say what
    happened."""
    try:
        from importlib.metadata import version

        import adaptdl.goodput  # noqa: F401
    except ImportError as err:
        return (f"NOT RUN: adaptdl is not importable here ({err}); `make bootstrap` installs "
                "it (requirements/test-env.txt), as does `make bench-env`")
    register(Chain("pollux", run_pollux, "tab:purple",
                   doc="Pollux: adaptdl's GoodputFunction + fit_perf_params, all-DP"))
    return f"adaptdl {version('adaptdl')} (GoodputFunction, fit_perf_params)"
