"""``predict collect``: measure real training-iteration times on the local device over a grid.

Grid: GPT-, BERT- and Llama-like transformers, a ViT and a ResNet-style conv net, each in a
few sizes, sequence lengths (transformers) and micro-batch sizes, at every precision the
device runs, single-process and data-parallel over ``--dp`` gloo processes (NCCL on GPUs).

Shared VMs have 3-10x contention episodes. Under time-sharing a step's wall time stretches by
whatever share other processes take, while the CPU time the step consumes does not, so
``seconds`` is a low quantile of the per-step *process CPU time* (one intra-op thread: CPU time
equals the wall time of an idle machine; the wall-clock quantile is kept as ``wall_s``). A
matmul canary against the session's best additionally backs off during severe episodes
(cache/memory-bandwidth interference, which CPU time does not hide), and its ratio is stored
with the row so evaluation can drop such rows. Output is a CSV appended row by row; a rerun skips rows already present
(resumable). The CPU profile the rows were measured with is stored next to it
(``<csv>.device.json``) so features are computed against the same calibration.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from predictors.datasets.measurements import KEY_COLUMNS
from predictors.spec import ParallelStrategy, TransformerSpec
from predictors.spec.model import UnknownModelError
from predictors.spec.precision import cpu_precisions
from predictors.time.zoo import ConvNetSpec, ViTSpec, ZooModel

COLUMNS = ("model", "family", "spec_kind", "spec_json", "seq", "precision", "micro_batch", "dp",
           "seconds", "median_s", "min_s", "wall_s", "repeats", "canary_ms", "canary_ratio",
           "threads", "timestamp")  # fmt: skip


def _tf(family: str, layers: int, hidden: int, heads: int, seq: int, **kw) -> TransformerSpec:
    kv = kw.pop("kv", None)
    return TransformerSpec(family, layers, hidden, heads, seq, 2048, num_query_groups=kv,
                           tied_embeddings=family != "llama", **kw)  # fmt: skip


def model_zoo(seq: int) -> dict[str, ZooModel]:
    """Named model sizes; transformer entries at sequence length ``seq``."""
    return {
        "gpt-xs": _tf("gpt", 2, 64, 2, seq),
        "gpt-s": _tf("gpt", 2, 128, 4, seq),
        "gpt-m": _tf("gpt", 3, 192, 6, seq),
        "llama-xs": _tf("llama", 2, 64, 2, seq, kv=1, ffn_hidden_size=176),
        "llama-s": _tf("llama", 2, 128, 4, seq, kv=2, ffn_hidden_size=344),
        "llama-m": _tf("llama", 3, 192, 6, seq, kv=2, ffn_hidden_size=512),
        "bert-xs": _tf("bert", 2, 64, 2, seq),
        "bert-s": _tf("bert", 2, 128, 4, seq),
        "bert-m": _tf("bert", 3, 192, 6, seq),
        "vit-xs": ViTSpec("vit", 2, 64, 2, 32, 8),
        "vit-s": ViTSpec("vit", 2, 128, 4, 32, 4),
        "vit-m": ViTSpec("vit", 3, 192, 6, 48, 6),
        "convnet-xs": ConvNetSpec("convnet", (8, 16), 1, 16),
        "convnet-s": ConvNetSpec("convnet", (16, 32), 1, 32),
        "convnet-m": ConvNetSpec("convnet", (16, 32, 64), 1, 32),
    }


@dataclass(frozen=True)
class GridPoint:
    model: str
    spec: ZooModel
    precision: str
    micro_batch: int
    dp: int = 1

    @property
    def key(self) -> tuple:
        return (self.model, str(_seq(self.spec)), self.precision, str(self.micro_batch),
                str(self.dp))  # fmt: skip


def _seq(spec: ZooModel) -> int:
    return getattr(spec, "seq_length", 0) if isinstance(spec, TransformerSpec) else 0


def unknown_models(models: Sequence[str], seq: int) -> str | None:
    """Why ``models`` cannot select from the zoo (None: each name is in it, and there is one):
    the grid keeps only the zoo names it is given, so a typo was dropped without a word and,
    alone, left an empty grid that measured nothing."""
    zoo = model_zoo(seq)
    unknown = [name for name in models if name not in zoo]
    if not unknown and models:
        return None
    what = f"{', '.join(map(repr, unknown))} unknown" if unknown else "names no model"
    return f"{what}; choose zoo names from {', '.join(zoo)}"


def default_grid(precisions: Iterable[str] | None = None, seqs=(32, 128), batches=(1, 4),
                 models: Iterable[str] | None = None, dp_sizes=(1, 2)) -> list[GridPoint]:  # fmt: skip
    precisions = cpu_precisions() if precisions is None else tuple(precisions)
    if models is not None and (why := unknown_models(models := tuple(models), seqs[0])):
        raise UnknownModelError(f"models={models}: {why}")
    points = []
    for dp in dp_sizes:
        for seq in seqs:
            zoo = model_zoo(seq)
            for name, spec in zoo.items():
                if models is not None and name not in models:
                    continue
                if not isinstance(spec, TransformerSpec) and seq != seqs[0]:
                    continue  # vision models have no sequence length to vary
                if dp > 1 and not name.endswith(("-xs", "-s")):
                    continue  # DP rows: the small sizes keep the two-process run short
                for mb in batches:
                    for p in precisions:
                        points.append(GridPoint(name, spec, p, mb, dp))
    # A fixed shuffle: a run cut short by its time budget still covers every family/precision.
    random.Random(0).shuffle(points)
    return points


def spec_to_row(spec: ZooModel) -> tuple[str, str]:
    d = asdict(spec)
    return type(spec).__name__, json.dumps(d, sort_keys=True)


def row_spec_strategy(row) -> tuple[ZooModel, ParallelStrategy]:
    kinds = {"TransformerSpec": TransformerSpec, "ViTSpec": ViTSpec, "ConvNetSpec": ConvNetSpec}
    d = json.loads(row["spec_json"])
    if "widths" in d:
        d["widths"] = tuple(d["widths"])
    spec = kinds[row["spec_kind"]](**d)
    dp, mb = int(row["dp"]), int(row["micro_batch"])
    return spec, ParallelStrategy(dp, 1, 1, mb, dp * mb)


# ---------------------------------------------------------------------------------------------
# Timing


def canary_ms() -> float:
    """Best-of-5 time of a fixed fp32 GEMM: the machine's current speed."""
    a = torch.randn(256, 256)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def time_steps(step, batch, repeats: int, warmup: int = 2, sync=None,
               budget_s: float = 2.0) -> tuple[list[float], list[float]]:  # fmt: skip
    """(CPU seconds, wall seconds) per step after ``warmup`` steps (the first allocates the
    optimizer state); slow points (e.g. fp16 on a CPU without fp16 units) stop after 3 repeats
    once ``budget_s`` is spent."""
    for _ in range(warmup):
        step(batch)
    cpu: list[float] = []
    wall: list[float] = []
    for i in range(repeats):
        if i >= 3 and sum(cpu) > budget_s:
            break
        if sync:
            sync()
        c0, t0 = time.process_time(), time.perf_counter()
        step(batch)
        if sync:
            sync()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return cpu, wall


def low_quantile(times: list[float], q: float = 0.2) -> float:
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure_point(point: GridPoint, repeats: int, group=None) -> tuple[list[float], list[float]]:
    from predictors.step import TrainingStep
    from predictors.time.zoo import build, make_batch

    torch.manual_seed(0)
    model = build(point.spec)
    sync, budget = None, 2.0
    if group is not None:  # ranks must run the same number of steps: no adaptive stop
        budget = float("inf")
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        sync = lambda: torch.distributed.barrier(group)  # noqa: E731
    step = TrainingStep(model, point.precision, target="cpu")
    batch = make_batch(point.spec, point.micro_batch)
    return time_steps(step, batch, repeats, sync=sync, budget_s=budget)


# ---------------------------------------------------------------------------------------------
# Data-parallel workers (gloo)


def _dp_worker(rank: int, world: int, port: int, threads: int, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            point, repeats = msg
            try:
                conn.send(("ok", measure_point(point, repeats, group=dist.group.WORLD)))
            except Exception as exc:  # report, keep the group alive for the next point
                conn.send(("error", repr(exc)))
    finally:
        dist.destroy_process_group()


class DataParallelPool:
    """``world`` persistent processes in one gloo group, measuring points in lockstep."""

    def __init__(self, world: int, threads: int = 1) -> None:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_dp_worker, args=(rank, world, port, threads, child))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def measure(self, point: GridPoint, repeats: int) -> tuple[list[float], list[float]]:
        for c in self.conns:
            c.send((point, repeats))
        replies = [c.recv() for c in self.conns]
        for status, value in replies:
            if status != "ok":
                raise RuntimeError(f"data-parallel worker failed on {point.key}: {value}")
        # the step ends when the slowest rank ends: per repeat, the larger CPU time
        (cpu0, wall0), (cpu1, _) = replies[0][1], replies[-1][1]
        return [max(a, b) for a, b in zip(cpu0, cpu1, strict=True)], wall0

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# ---------------------------------------------------------------------------------------------
# Driver


def done_counts(path: Path) -> dict[tuple, int]:
    """How many passes each grid point already has in ``path``."""
    counts: dict[tuple, int] = {}
    if path.exists():
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                key = tuple(r[k] for k in KEY_COLUMNS)
                counts[key] = counts.get(key, 0) + 1
    return counts


def device_profile_path(csv_path: Path) -> Path:
    return Path(csv_path).with_suffix(".device.json")


def features_cache_path(csv_path: Path) -> Path:
    """Feature rows of a measurement file (see :func:`predictors.time.feature_sets.measurement_features`)."""
    return Path(csv_path).with_suffix(".features.json")


def collect(out: str | Path, points: list[GridPoint], *, repeats: int = 5,
            max_minutes: float = 20.0, threads: int = 1, max_canary_ratio: float = 3.0,
            passes: int = 1, progress: bool = True) -> Path:  # fmt: skip
    """Measure ``points`` that have fewer than ``passes`` rows in ``out``; stop cleanly after
    ``max_minutes``. Several passes sample independent contention episodes: the loader keeps
    the fastest pass of each point."""
    from tqdm import tqdm

    from predictors.devices import cpu_device

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    profile = device_profile_path(out)
    if not profile.exists():
        profile.write_text(json.dumps(cpu_device(threads).to_dict(), indent=2))
    counts = done_counts(out)
    todo = [p for p in points if counts.get(p.key, 0) < passes]
    deadline = time.monotonic() + max_minutes * 60
    best_canary = canary_ms()
    pools: dict[int, DataParallelPool] = {}
    new_file = not out.exists()
    try:
        with open(out, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            if new_file:
                writer.writeheader()
            bar = tqdm(todo, desc="predict collect", unit="pt", disable=not progress)
            for point in bar:
                if time.monotonic() > deadline:
                    bar.write(f"time budget of {max_minutes} min reached; rerun to resume")
                    break
                row = _measure_with_canary(point, repeats, threads, pools, best_canary,
                                           max_canary_ratio)  # fmt: skip
                best_canary = min(best_canary, row["canary_ms"])
                writer.writerow(row)
                f.flush()
                bar.set_postfix(model=point.model, prec=point.precision,
                                ms=f"{row['seconds'] * 1e3:.1f}")  # fmt: skip
    finally:
        for pool in pools.values():
            pool.close()
    return out


def _measure_with_canary(point, repeats, threads, pools, best_canary, max_ratio) -> dict:
    for attempt in range(4):
        canary = canary_ms()
        if canary <= max_ratio * best_canary or attempt == 3:
            break
        time.sleep(2.0 * (attempt + 1))  # contention episode: back off, then re-check
    if point.dp > 1:
        if point.dp not in pools:
            pools[point.dp] = DataParallelPool(point.dp, threads)
        times, wall = pools[point.dp].measure(point, repeats)
    else:
        times, wall = measure_point(point, repeats)
    canary = min(canary, canary_ms())
    kind, spec_json = spec_to_row(point.spec)
    return {
        "model": point.model, "family": point.spec.family, "spec_kind": kind,
        "spec_json": spec_json, "seq": _seq(point.spec), "precision": point.precision,
        "micro_batch": point.micro_batch, "dp": point.dp, "seconds": low_quantile(times),
        "median_s": sorted(times)[len(times) // 2], "min_s": min(times),
        "wall_s": low_quantile(wall), "repeats": len(times),
        "canary_ms": canary, "canary_ratio": canary / best_canary, "threads": threads,
        "timestamp": time.time(),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Interleaved collection (one process, round-robin)


def collect_interleaved(out: str | Path, points: list[GridPoint], *, rounds: int = 5,
                        steps_per_round: int = 2, threads: int = 1,
                        progress: bool = True) -> Path:  # fmt: skip
    """Measure every single-process point round-robin: each round times ``steps_per_round``
    steps of every configuration in turn, so a drift of the machine's speed (this VM drifts
    by -25%..+60% within an hour) hits all configurations alike instead of biasing whichever
    ones happened to be measured during it. ``seconds`` is the median over rounds of each
    round's fastest step (CPU time); a contention episode spoils one round, not the point.
    Writes a fresh CSV (same columns as :func:`collect`) plus its device profile."""
    from tqdm import tqdm

    from predictors.devices import cpu_device
    from predictors.step import TrainingStep
    from predictors.time.zoo import build, make_batch

    if any(p.dp != 1 for p in points):
        raise ValueError("collect_interleaved: points must have dp=1 (DP runs use collect())")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    device_profile_path(out).write_text(json.dumps(cpu_device(threads).to_dict(), indent=2))
    runners = []
    for point in points:
        torch.manual_seed(0)
        step = TrainingStep(build(point.spec), point.precision, target="cpu")
        batch = make_batch(point.spec, point.micro_batch)
        step(batch)  # allocates the optimizer state
        runners.append((step, batch))
    per_round: list[list[float]] = [[] for _ in points]
    walls: list[list[float]] = [[] for _ in points]
    canaries = []
    for _ in tqdm(range(rounds), desc="predict collect (interleaved)", disable=not progress):
        canaries.append(canary_ms())
        for i, (step, batch) in enumerate(runners):
            cpu, wall = time_steps(step, batch, steps_per_round, warmup=1, budget_s=float("inf"))
            per_round[i].append(min(cpu))
            walls[i].append(min(wall))
    best_canary = min(canaries)
    canary = statistics.median(canaries)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for point, times, wall in zip(points, per_round, walls, strict=True):
            kind, spec_json = spec_to_row(point.spec)
            writer.writerow({
                "model": point.model, "family": point.spec.family, "spec_kind": kind,
                "spec_json": spec_json, "seq": _seq(point.spec), "precision": point.precision,
                "micro_batch": point.micro_batch, "dp": 1, "seconds": statistics.median(times),
                "median_s": statistics.median(times), "min_s": min(times),
                "wall_s": statistics.median(wall), "repeats": len(times) * steps_per_round,
                "canary_ms": canary, "canary_ratio": canary / best_canary, "threads": threads,
                "timestamp": time.time(),
            })  # fmt: skip
    return out
