"""Fold a GPU run's results into the predictors' data (and optionally retrain), with provenance.

    python -m gpucheck.fold RESULTS_DIR [--data-dir predictors/data] [--train]

* memory: the ``ok`` rows of the predictor's preset families (llava, vit, llm) are appended to
  ``memory_ground_truth.csv`` in its own columns; their ``ground_truth`` names the GPU, driver,
  CUDA, torch, date and commit of the run. Keys already there are skipped (rerunnable).
* time: the ``ok`` rows go to ``time_<gpu>.csv`` (every column of ``time.csv``, provenance
  included; ``predict collect``'s loader reads it) with ``time_<gpu>.device.json``: the device
  table's entry for the detected GPU with NVML's memory size.
* megatron: the megatron part's ``ok`` ``timed_step`` rows (Megatron-Core steps through CONA's
  runtime) go to ``time_<gpu>_megatron.csv``, which the time predictor's fleet loader reads as
  framework ``megatron`` development rows (``predictors.datasets.fleet.load_megatron_steps``).
* ``--train``: retrains the memory residual model on the merged ground truth and trains the GPU
  family's time correction (``predictors/models/time_<family>``) on the time rows.

``--parts memory``, ``--parts time`` or ``--parts megatron`` folds one file only (a rerun of one part goes to its own
folder); ``--commit SHA`` names the commit that was sent, where the device machine's copy of the
tree reported another (its ``git_commit`` is whatever HEAD the copied tree carried).

A dry run's results are refused: they hold no GPU ground truth.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

from gpucheck import adapters
from gpucheck.common import ROOT

PRESET_FAMILIES = ("llava", "vit", "llm")


class FoldError(ValueError):
    """The results folder cannot be folded (named reason)."""


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _provenance_text(p: dict) -> str:
    return (f"{p['gpu']}, driver {p['driver']}, CUDA {p['cuda']}, torch {p['torch']}, "
            f"{p['date']}, commit {p['git_commit']}")


def load_run(results: Path, commit: str | None = None) -> dict:
    run_path = results / "run.json"
    if not run_path.exists():
        raise FoldError(f"{run_path} missing: not a gpu_check results folder")
    run = json.loads(run_path.read_text())
    if run.get("dry_run"):
        raise FoldError(f"{results} holds a dry run (cpu): no GPU ground truth to fold")
    if commit:
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            raise FoldError(f"commit={commit!r} is not a git commit hash")
        run["provenance"]["git_commit"] = f"{commit} (sent; the run reported " \
                                          f"{run['provenance'].get('git_commit')})"
    return run


def fold_memory(results: Path, data_dir: Path, provenance: dict) -> tuple[Path, int]:
    target = data_dir / "memory_ground_truth.csv"
    existing = _rows(target)
    if not existing:
        raise FoldError(f"{target} missing or empty: fold into the predictor's data set only")
    columns = list(existing[0])
    seen = {r["key"] for r in existing}
    new = []
    for r in _rows(results / "memory.csv"):
        if r["status"] != "ok" or r["family"] not in PRESET_FAMILIES or r["key"] in seen:
            continue
        row = {c: r[c] for c in columns}
        row["ground_truth"] = f"{r['ground_truth']} on {_provenance_text(provenance)}"
        new.append(row)
    with open(target, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=columns).writerows(new)
    return target, len(new)


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"


def fold_time(results: Path, data_dir: Path, run: dict) -> tuple[Path, int]:
    prov = run["provenance"]
    rows = [{**r, "git_commit": prov["git_commit"]}
            for r in _rows(results / "time.csv") if r["status"] == "ok"]
    if not rows:
        raise FoldError(f"{results / 'time.csv'} has no ok rows")
    target = data_dir / f"time_{gpu_slug(prov['gpu'])}.csv"
    existing = _rows(target)
    keys = {(r["model"], r["precision"], r["micro_batch"], r["date"]) for r in existing}
    new = [r for r in rows if (r["model"], r["precision"], r["micro_batch"], r["date"]) not in keys]
    with open(target, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if not existing:
            w.writeheader()
        w.writerows(new)
    nvml = run["parts"].get("device", {}).get("summary", {}).get("nvml", {})
    key, table = adapters.table_device(prov["gpu"], nvml.get("memory_total") or 0)
    if table is None:
        raise FoldError(f"gpu={prov['gpu']!r} matches no entry of the predictors' device table")
    profile = table.to_dict()
    if nvml.get("memory_total"):
        profile["memory_bytes"] = float(nvml["memory_total"])
    adapters.write_device_profile(target, profile)
    return target, len(new)


def fold_megatron(results: Path, data_dir: Path, run: dict) -> tuple[Path, int]:
    """The megatron part's ``ok`` ``timed_step`` rows into ``time_<gpu>_megatron.csv`` (the
    predictors' fleet loader reads every such file as framework megatron rows); rows of the
    same spec, strategy, precision and run date already there are skipped."""
    prov = run["provenance"]
    columns = adapters.megatron_step_columns()
    target = data_dir / adapters.megatron_steps_file(gpu_slug(prov["gpu"]))
    rows = []
    for r in _rows(results / "megatron.csv"):
        if r["event"] != "timed_step" or r["status"] != "ok":
            continue
        d = json.loads(r["detail"])
        spec = d["spec"]
        rows.append({"model": f"{spec['family']}-h{spec['hidden_size']}-l{spec['num_layers']}",
                     "spec_json": json.dumps(spec, sort_keys=True), "strategy": r["strategy"],
                     "precision": r["precision"], "seconds": r["seconds"],
                     "median_s": d["median_s"], "min_s": d["min_s"],
                     "iterations": r["iteration"],
                     "pred_seconds_before": d.get("pred_seconds", ""),
                     **{k: r[k] for k in ("gpu", "driver", "cuda", "torch", "date")},
                     "git_commit": prov["git_commit"]})  # fmt: skip
    existing = _rows(target)
    key = lambda r: (r["spec_json"], r["strategy"], r["precision"], r["date"])  # noqa: E731
    seen = {key(r) for r in existing}
    new = [r for r in rows if key(r) not in seen]
    if new:
        with open(target, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            if not existing:
                w.writeheader()
            w.writerows(new)
    return target, len(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpucheck.fold", description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a folder written by scripts/gpu_check.py")
    p.add_argument("--data-dir", type=Path, default=ROOT / "predictors" / "data")
    p.add_argument("--train", action="store_true", help="retrain the memory and time models")
    p.add_argument("--models-dir", type=Path, default=ROOT / "predictors" / "models")
    p.add_argument("--parts", default="memory,time,megatron",
                   help="any of memory, time, megatron (default: all three)")
    p.add_argument("--commit", default=None, help="the commit sent to the device machine")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"memory", "time", "megatron"}:
        print(f"fold: error: --parts={args.parts!r}: any of memory, time, megatron",
              file=sys.stderr)
        return 2
    try:
        run = load_run(args.results, args.commit)
        if "memory" in parts:
            mem_path, mem_rows = fold_memory(args.results, args.data_dir, run["provenance"])
            print(f"memory: {mem_rows} GPU rows appended to {mem_path}")
        if "time" in parts:
            time_path, time_rows = fold_time(args.results, args.data_dir, run)
            print(f"time: {time_rows} GPU rows in {time_path} (+ device profile)")
        if "megatron" in parts:
            mc_path, mc_rows = fold_megatron(args.results, args.data_dir, run)
            print(f"megatron: {mc_rows} timed Megatron-Core steps in {mc_path}")
    except FoldError as exc:
        print(f"fold: error: {exc}", file=sys.stderr)
        return 2
    if args.train and "memory" in parts:
        print(f"memory model: {adapters.train_memory_model(mem_path)}")
    if args.train and "time" in parts:
        print(f"time model: {adapters.train_time_family_model(time_path, args.models_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
