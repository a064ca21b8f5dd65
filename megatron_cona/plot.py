"""Plots: loss vs (simulated) time with each chain's strategy timeline, and a training run's
strategy timeline from its CONA decision log (``--cona-log``)."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable
from itertools import groupby
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class DecisionLogError(ValueError):
    """A ``--cona-log`` that is not a decision log: the message names the file and the line."""


def _segments(xs: list[float], labels: list[str]) -> list[tuple[float, float, str]]:
    """Consecutive runs of equal label as (start, end, label)."""
    out: list[tuple[float, float, str]] = []
    start = 0.0
    for i, label in enumerate(labels):
        if i + 1 == len(labels) or labels[i + 1] != label:
            out.append((start, xs[i], label))
            start = xs[i]
    return out


def _timeline(ax, segments, row: float, palette: dict[str, tuple]) -> None:
    for start, end, label in segments:
        color = palette.setdefault(label, plt.cm.tab20(len(palette) % 20))
        ax.barh(row, end - start, left=start, height=0.8, color=color, edgecolor="white")
        if end - start > 0:
            ax.text((start + end) / 2, row, label.replace("mb", "\nmb"), ha="center",
                    va="center", fontsize=6)


def _timelines_and_save(fig, bottom, rows: dict[str, tuple[list, list]], note: str,
                        path: Path, dpi: int) -> Path:
    """The strategy timelines of ``rows`` (name -> (times, strategies)) under a chain plot,
    the note below, saved."""
    palette: dict[str, tuple] = {}
    for row, (times, strategies) in enumerate(rows.values()):
        _timeline(bottom, _segments(times, strategies), row, palette)
    bottom.set_yticks(range(len(rows)), list(rows))
    bottom.set_xlabel("SIMULATED time (s)")
    fig.text(0.01, 0.005, textwrap.fill(note, 160), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_sim(case: dict, note: str, path: Path) -> Path:
    """One law-simulation case: loss vs time of every chain (its best run for the far target)
    and the strategy timelines of CONA and of the per-interval oracle."""
    from megatron_cona.lawsim.chains import CHAINS

    far = list(case["targets"])[-1]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for name, per in case["chains"].items():
        pts = [p for p in per[far]["points"] if not math.isnan(p["loss"])]
        if pts:
            top.plot([p["time"] for p in pts], [p["loss"] for p in pts],
                     color=CHAINS[name].color if name in CHAINS else None,
                     label=f"{name} ({per[far]['time_s']:.4g}s, {per[far]['switches']} switches)")
    for name, target in case["targets"].items():
        top.axhline(target["loss"], color="k", ls=":", lw=0.8, label=f"target {name}")
    top.set_ylabel("loss (law)")
    top.set_xscale("log")
    top.set_title(f"{case['tag']} [{case['clock']}]", fontsize=10)
    top.legend(fontsize=7)
    chains = case["chains"]
    rows = {n: ([p["time"] for p in chains[n][far]["points"]],
                [p["strategy"] for p in chains[n][far]["points"]])
            for n in ("cona", "oracle") if n in chains}
    return _timelines_and_save(fig, bottom, rows, note, path, 110)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class _Field(NamedTuple):
    keys: tuple[str, ...]  # its path: ("best", "goodput") is decision["best"]["goodput"]
    kind: str  # what the value must be, as the error says it
    ok: Callable[[object], bool]
    required: bool = True  # an absent optional field reads as NaN


# What plot_run_timeline reads of each decision and computes with: a missing field was a
# KeyError, a wrong type a TypeError deep in matplotlib (goodput may be NaN or inf: the policy
# logs what it estimated). The fields of one object stay adjacent: the presence check groups
# them ("no current.strategy/goodput").
_DECISION_FIELDS = (
    _Field(("iteration",), "an integer >= 0",
           lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0),
    _Field(("switch",), "true or false", lambda x: isinstance(x, bool)),
    _Field(("current", "strategy"), "a strategy name", lambda x: isinstance(x, str)),
    _Field(("current", "goodput"), "a number", _is_real),
    _Field(("best", "strategy"), "a strategy name", lambda x: isinstance(x, str)),
    _Field(("best", "goodput"), "a number", _is_real),
    _Field(("noise_scale",), "a number", _is_real, required=False),
)


def read_decisions(log_path: Path) -> list[dict]:
    """The decisions of a ``--cona-log`` file; a line that is not one raises DecisionLogError
    naming the file, the line and what it lacks."""
    decisions = []
    with open(log_path, encoding="utf-8") as fh:
        try:
            lines = list(fh)
        except UnicodeDecodeError as err:  # a binary file: a traceback before
            raise DecisionLogError(f"--cona-log {log_path}: not UTF-8 text ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--cona-log {log_path} line {number}"
        try:
            decision = json.loads(line)
        except json.JSONDecodeError as err:
            raise DecisionLogError(f"{where}: not JSON ({err})") from None
        # every required field present before any type is checked: another log's line is named
        # for what it lacks, not for a type
        required = (f for f in _DECISION_FIELDS if f.required)
        for key, fields in groupby(required, key=lambda f: f.keys[0]):
            inner = [f.keys[1] for f in fields if len(f.keys) > 1]
            value = decision.get(key) if isinstance(decision, dict) else None
            if value is None or inner and not (isinstance(value, dict)
                                               and all(k in value for k in inner)):
                raise DecisionLogError(f"{where}: no {key}{'.' + '/'.join(inner) if inner else ''} "
                                       "(not a CONA decision log)")
        for field in _DECISION_FIELDS:
            first, *rest = field.keys
            value = decision.get(first, math.nan)
            for inner_key in rest:
                value = value[inner_key]
            if not field.ok(value):
                raise DecisionLogError(f"{where}: {'.'.join(field.keys)}={value!r} is not "
                                       f"{field.kind}")
        decisions.append(decision)
    return decisions


def plot_run_timeline(log_path: Path, path: Path, losses: list[float] | None = None) -> Path:
    """Strategy timeline (and training loss, when given) of a run from its decision log."""
    decisions = read_decisions(log_path)
    if not decisions:
        raise DecisionLogError(f"--cona-log {log_path} holds no decisions")
    iters = [d["iteration"] for d in decisions]
    labels = [d["current"]["strategy"] for d in decisions]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    if losses:
        top.plot(range(1, len(losses) + 1), losses, lw=0.8)
        top.set_ylabel("training loss")
    else:  # what the log holds: the goodput of the running and of the best candidate, and phi
        top.plot(iters, [d["current"]["goodput"] for d in decisions], marker=".",
                 label="running strategy")
        top.plot(iters, [d["best"]["goodput"] for d in decisions], marker=".", ls="--",
                 label="best candidate")
        top.set_ylabel("goodput (base-batch samples/s)")
        phis = [d.get("noise_scale", math.nan) for d in decisions]
        if any(math.isfinite(x) for x in phis):
            twin = top.twinx()
            twin.plot(iters, phis, color="tab:gray", lw=0.8, label="noise scale")
            twin.set_ylabel("noise scale (samples)", color="tab:gray")
        top.legend(fontsize=7, loc="upper left")
    for d in decisions:
        if d["switch"]:
            top.axvline(d["iteration"], color="tab:red", lw=0.8, ls=":")
    xs, names = list(iters), list(labels)
    last = decisions[-1]
    end = len(losses) if losses else iters[-1] + (iters[-1] - iters[-2] if len(iters) > 1 else 1)
    if end > iters[-1]:  # after the last ranking: the strategy it left running
        xs.append(end)
        names.append(last["best"]["strategy"] if last["switch"] else labels[-1])
    _timeline(bottom, _segments(xs, names), 0, {})
    bottom.set_yticks([0], ["strategy"])
    bottom.set_xlabel("iteration")
    top.set_title(f"CONA: {sum(d['switch'] for d in decisions)} switch(es) in "
                  f"{len(decisions)} rankings", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
