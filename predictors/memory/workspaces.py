"""cuDNN's transient convolution workspaces on tensor cores, fitted on real allocator streams.

PyTorch's tensors are NCHW; cuDNN's tensor-core kernels (TF32, bf16, fp16) work in NHWC, so a
convolution call usually takes a workspace through the caching allocator for the transposed
copies of its three tensors, allocated after the call's output and freed when the call ends.
The H200 event streams of the GPU kit (``predictors/data/gpu/h200-2026-12-04-run5``) show it:
aligned with the traced step (:func:`samples`), the median workspace of a spatial convolution
is 1.00 x (input + output + weight bytes) in the forward, the backward-data and the
backward-filter call, in TF32 and bf16; 1x1 stride-1 convolutions mostly take none in the
forward; the stem (the image input) a little more. Strided convolutions and strided stems are
classes of their own: FFT and Winograd algorithms need stride 1, and in true fp32 the strided
ones take none in most forward and backward-data calls and ~1 x in the backward-filter call
where the stride-1 ones take ~2.3 x; a stride-2 7x7 stem (ResNet, DenseNet) takes a layout
copy on tensor cores where a stride-1 3x3 one (VGG, U-Net) mostly takes none. The model
(:class:`WorkspaceModel`) is a ratio per (tensor-core class, call, kernel class), fitted as
the median over the networks of each one's median over its aligned calls that took one, or
none where most took none, every network counting once (:func:`fit`); the shipped one is
fitted on every recorded network (``predictors/models/cudnn_workspaces.json``, written by the memory
benchmark's ``--write-workspaces``), and evaluations fit it without the network they score.
True-fp32 convolutions (TF32 off) are a class of their own (``fp32``), fitted the same way on
the fp32 streams: cuDNN's NCHW algorithms take no workspace in most forward and backward-data
calls and ~2-3 x the three tensors in the backward-filter call; the few FFT-sized forward
workspaces are beyond a per-call median. A model without fp32 ratios leaves them to the
explicit-GEMM bound of :mod:`tracker`.
"""

from __future__ import annotations

import difflib
import json
import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .cuda_events import RecordedStep

WORKSPACES_JSON = Path(__file__).resolve().parents[1] / "models" / "cudnn_workspaces.json"
CALLS = ("forward", "backward_data", "backward_filter")
KERNELS = ("stem", "strided_stem", "pointwise", "strided", "spatial")
# A model fitted before a class was split off falls back to the class it was part of.
_SPLIT_FROM = {"strided": "spatial", "strided_stem": "stem"}


@dataclass(frozen=True)
class ConvCall:
    """One cuDNN call of a convolution: which call, its kernel class and the bytes of its
    three tensors (input, output, weight at the compute dtype)."""

    call: str  # forward | backward_data | backward_filter
    kernel: str  # stem | strided_stem (<= 4 input channels) | pointwise (1x1) | strided | spatial
    layout_bytes: int  # input + output + weight

    @classmethod
    def of(cls, call: str, in_channels: int, kernel: Sequence[int], stride: Sequence[int],
           layout_bytes: int) -> ConvCall:
        if in_channels <= 4:
            k = "stem" if all(int(s) == 1 for s in stride) else "strided_stem"
        elif any(int(s) != 1 for s in stride):
            k = "strided"
        elif all(int(d) == 1 for d in kernel):
            k = "pointwise"
        else:
            k = "spatial"
        return cls(call, k, layout_bytes)


TENSOR_CORE_CLASSES = ("tf32", "half")


def workspace_class(dtype: torch.dtype, tf32: bool) -> str:
    """The class of a convolution whose input is ``dtype`` with cuDNN's TF32 switch ``tf32``:
    ``tf32`` for fp32 inputs on tensor cores, ``half`` for bf16 / fp16, ``fp32`` for true fp32
    (TF32 off: cuDNN's NCHW kernels, other algorithms) and any other dtype."""
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    return "tf32" if tf32 and dtype == torch.float32 else "fp32"


@dataclass(frozen=True)
class Sample:
    """An aligned call: the workspace the real stream allocated for it (0: none)."""

    network: str
    cls: str  # workspace_class
    conv: ConvCall
    workspace: int


@dataclass(frozen=True)
class WorkspaceModel:
    """``workspace = ratio x layout_bytes`` per ``(class, call, kernel)``; a key it lacks gets
    the same call and kernel of the other tensor-core class, else none."""

    ratios: dict[tuple[str, str, str], float]
    source: str = ""

    def has_class(self, cls: str) -> bool:
        return any(k[0] == cls for k in self.ratios)

    def workspace(self, cls: str, conv: ConvCall) -> int:
        r = self.ratios.get((cls, conv.call, conv.kernel))
        if r is None and conv.kernel in _SPLIT_FROM:
            r = self.ratios.get((cls, conv.call, _SPLIT_FROM[conv.kernel]))
        if r is None and cls in TENSOR_CORE_CLASSES:
            other = "half" if cls == "tf32" else "tf32"
            r = self.ratios.get((other, conv.call, conv.kernel))
        return int((r or 0.0) * conv.layout_bytes)

    def save(self, path: Path = WORKSPACES_JSON) -> None:
        path.write_text(json.dumps({"source": self.source, "ratios": [
            {"class": c, "call": k, "kernel": n, "ratio": r}
            for (c, k, n), r in sorted(self.ratios.items())]}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path = WORKSPACES_JSON) -> WorkspaceModel:
        d = json.loads(path.read_text())
        return cls({(r["class"], r["call"], r["kernel"]): r["ratio"] for r in d["ratios"]},
                   d["source"])


def fit(samples: Iterable[Sample], source: str = "") -> WorkspaceModel:
    """Per ``(class, call, kernel)``, every network counting once whatever its number of calls:
    none when, on average over the networks, most of a network's aligned calls took no
    workspace, else the median over the networks of each one's median ``workspace /
    layout_bytes`` over its calls that took one. Per call instead, one network with many calls
    sets the rule for the others (DenseNet-121's 116 spatial convolutions put the fp32 and
    TF32 backward-filter ratios at its own 2.98 where the other four networks' are 2.26-2.30
    and 1.02-1.13)."""
    groups: dict[tuple[str, str, str], dict[str, list[Sample]]] = {}
    for s in samples:
        groups.setdefault((s.cls, s.conv.call, s.conv.kernel), {}).setdefault(
            s.network, []).append(s)
    ratios = {}
    for key, by_net in groups.items():
        took = {net: [s.workspace / s.conv.layout_bytes for s in g if s.workspace > 0]
                for net, g in by_net.items()}
        share = statistics.fmean(len(took[net]) / len(g) for net, g in by_net.items())
        medians = [statistics.median(r) for r in took.values() if r]
        ratios[key] = statistics.median(medians) if share > 0.5 else 0.0
    n = sum(len(g) for by_net in groups.values() for g in by_net.values())
    nets = len({net for by_net in groups.values() for net in by_net})
    return WorkspaceModel(ratios, source or f"median over {nets} networks of their median "
                                            f"ratios ({n} aligned calls)")


_CURRENT: list[WorkspaceModel] = []
# The traced step's allocations, in order, each with the convolution call whose output it is
# (None for any other), recorded by :class:`tracker.MemoryTracker` inside :func:`recording`.
TracedAlloc = tuple[int, "ConvCall | None"]
_RECORDING: list[list[TracedAlloc]] = []


def register_model(model: WorkspaceModel | None) -> None:
    """Make ``model`` the one traced steps use (None: the shipped one again); an evaluation
    registers a model fitted without the network it scores."""
    _CURRENT[:] = [] if model is None else [model]


def current_model() -> WorkspaceModel | None:
    """The model a traced step inserts workspaces with; None while :func:`recording`."""
    if _RECORDING:
        return None
    if not _CURRENT:
        _CURRENT.append(WorkspaceModel.load())
    return _CURRENT[0]


@contextmanager
def recording() -> Iterator[list[TracedAlloc]]:
    """Within it, traced steps insert no modelled workspace and log the reported step's
    allocations into the yielded list (what :func:`samples` aligns with a real stream)."""
    log: list[TracedAlloc] = []
    _RECORDING.append(log)
    try:
        yield log
    finally:
        _RECORDING.remove(log)


def record(nbytes: int, conv: ConvCall | None) -> None:
    """Log one traced allocation if a :func:`recording` is active."""
    if _RECORDING:
        _RECORDING[-1].append((nbytes, conv))


def clear_record() -> None:
    """Forget what was logged so far (the tracker calls it when the reported step starts)."""
    if _RECORDING:
        _RECORDING[-1].clear()


def samples(network: str, cls: str, traced: Sequence[TracedAlloc],
            real: RecordedStep) -> list[Sample]:
    """Align the traced allocations with the real stream's by size (the same tensors come in
    the same order; :mod:`difflib`'s longest matching blocks); every real allocation the trace
    lacks that is freed before the next allocation (a transient) is the workspace of the call
    whose output is the traced allocation just before it. A call with no such transient took
    none. ``traced``: a :func:`recording` (no modelled workspaces in it)."""
    allocs = [(i, e) for i, e in enumerate(real.events) if e[0] == "alloc"]
    transient = []
    for n, (i, e) in enumerate(allocs):
        end = allocs[n + 1][0] if n + 1 < len(allocs) else len(real.events)
        transient.append(any(f[0] == "free_requested" and f[1] == e[1]
                             for f in real.events[i + 1:end]))
    sm = difflib.SequenceMatcher(None, [b for b, _ in traced], [e[2] for _, e in allocs],
                                 autojunk=False)
    match = {b + k: a + k for a, b, n in sm.get_matching_blocks() for k in range(n)}
    taken: dict[int, int] = {}  # traced index of the call's output -> its workspace
    prev = None
    for r in range(len(allocs)):
        if r in match:
            prev = match[r]
        elif transient[r] and prev is not None and traced[prev][1] is not None:
            taken.setdefault(prev, allocs[r][1][2])
    return [Sample(network, cls, conv, taken.get(i, 0)) for i, (_, conv) in enumerate(traced)
            if conv is not None]
