"""A TorchDispatchMode that sees every storage a traced step allocates and frees.

Run it inside ``FakeTensorMode`` (fake tensors on ``cpu``): no real memory is used, yet each op's
outputs carry their real sizes. A storage is *allocated* the first time an op returns it and
*freed* when its ``UntypedStorage`` is finalized (weak-ref finalizer), exactly when the CUDA
caching allocator would get the block back. Each storage gets a label, and the stream is
replayed live through :class:`CachingAllocatorSim`.

Labels: ``parameter`` (registered before the step), ``gradient`` (becomes a ``.grad``),
``optimizer_state`` (lives in ``optimizer.state``), ``activation`` (allocated in the forward and
still alive when the forward ends, i.e. saved for backward), ``workspace`` (modelled cuBLAS and
cuDNN workspaces: :mod:`workspaces` on tensor cores) and ``temporary`` (everything else).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import workspaces
from .allocator import CachingAllocatorSim, SimulatedOutOfMemoryError
from .overheads import NONE, CudaOverheads
from .workspaces import ConvCall

LABELS = ("parameter", "gradient", "optimizer_state", "activation", "workspace", "temporary")
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addmv", "mv", "dot"}
_UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"
_CONVS = {"convolution", "convolution_backward"}


@dataclass
class _Record:
    nbytes: int
    label: str
    phase: str
    module: str
    op: str
    handle: int
    alloc_seq: int
    free_seq: int | None = None
    block: int = 0  # bytes the allocator counts allocated for it (its rounded block)


@dataclass
class PeakSnapshot:
    allocated: int = 0
    phase: str = ""
    seq: int = 0


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class MemoryTracker(TorchDispatchMode):
    """Track storages; ``phase`` is set by the step driver (forward/loss/backward/optimizer)."""

    def __init__(self, allocator: CachingAllocatorSim | None = None,
                 overheads: CudaOverheads = NONE, tf32: bool = False) -> None:
        super().__init__()
        self.allocator = allocator or CachingAllocatorSim()
        self.overheads = overheads
        self.tf32 = tf32  # fp32 convolutions on tensor cores (torch.backends.cudnn.allow_tf32)
        self.phase = "setup"
        self._live: dict[int, _Record] = {}
        self._by_label: dict[str, int] = defaultdict(int)
        self._module_stack: list[str] = []
        self._workspace_phases: set[str] = set()
        self._records: list[_Record] = []
        self._seq = 0
        self._reset_seq = 0  # the step measured starts after it (reset_peak)
        self.peak = PeakSnapshot()
        self.phase_peaks: dict[str, int] = {}
        self.module_saved: dict[str, int] = defaultdict(int)
        self._found_inf: set[int] = set()  # storages of grad-scaler found-inf flags
        self.convolutions = 0  # a step with any loads cuDNN (its kernels outside the allocator)

    # -- bookkeeping --------------------------------------------------------------------------
    def _alloc(self, key: int, nbytes: int, label: str, op: str,
                conv: ConvCall | None = None) -> _Record:
        before = self.allocator.stats.allocated
        handle = self.allocator.malloc(nbytes)
        if label != "workspace":
            workspaces.record(nbytes, conv)
        module = self._module_stack[-1] if self._module_stack else ""
        self._seq += 1
        rec = _Record(nbytes, label, self.phase, module, op, handle, self._seq,
                      block=self.allocator.stats.allocated - before)
        self._live[key] = rec
        self._records.append(rec)
        self._by_label[label] += nbytes
        allocated = self.allocator.stats.allocated
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), allocated)
        if allocated > self.peak.allocated:
            self.peak = PeakSnapshot(allocated, self.phase, self._seq)
        return rec

    def _free(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is None:
            return
        self._by_label[rec.label] -= rec.nbytes
        self._seq += 1
        rec.free_seq = self._seq
        self.allocator.free(rec.handle)

    def _watch(self, t: torch.Tensor, label: str, op: str,
               conv: ConvCall | None = None) -> bool:
        """Account for ``t``'s storage if it is new; whether it was."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live or storage.nbytes() == 0:
            return False
        self._alloc(key, storage.nbytes(), label, op, conv)
        weakref.finalize(storage, self._free, key)
        return True

    def register(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Account for storages that exist before tracking starts (parameters, inputs)."""
        for t in tensors:
            self._watch(t, label, "register")

    def relabel(self, tensors: Iterable[torch.Tensor | None], label: str) -> None:
        for t in tensors:
            if t is None:
                continue
            rec = self._live.get(_storage_key(t))
            if rec is not None and rec.label != label:
                self._by_label[rec.label] -= rec.nbytes
                self._by_label[label] += rec.nbytes
                rec.label = label

    def end_forward(self) -> None:
        """What the forward allocated and is still alive now is saved for backward."""
        for rec in self._live.values():
            if rec.phase == "forward" and rec.label == "temporary":
                self._by_label["temporary"] -= rec.nbytes
                self._by_label["activation"] += rec.nbytes
                rec.label = "activation"
                self.module_saved[rec.module] += rec.nbytes

    def reset_peak(self) -> None:
        workspaces.clear_record()
        self.allocator.reset_peak()
        self.peak = PeakSnapshot(self.allocator.stats.allocated, self.phase, self._seq)
        self.phase_peaks = {}
        self._records = [r for r in self._records if r.free_seq is None]
        self._reset_seq = self._seq

    def phase_peaks_without(self, label: str) -> dict[str, int]:
        """Per phase, the most allocated bytes (as :attr:`phase_peaks` counts them) outside the
        storages of (final) ``label`` since :meth:`reset_peak`: what the step holds where a
        framework keeps those tensors elsewhere (Megatron's gradient buffer in place of
        ``.grad``). Its peaks can fall at other moments than the traced peak's, so they are
        swept over the whole stream."""
        events = []  # (seq, bytes, phase of an allocation); seqs are unique
        for r in self._records:
            if r.label != label:
                events.append((r.alloc_seq, r.block, r.phase))
                if r.free_seq is not None:
                    events.append((r.free_seq, -r.block, ""))
        live, out = 0, {}
        for seq, nbytes, phase in sorted(events):
            live += nbytes
            if nbytes > 0 and seq > self._reset_seq:
                out[phase] = max(out.get(phase, 0), live)
        return out

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per (final) label of the storages live at the allocated peak."""
        out = dict.fromkeys(LABELS, 0)
        seq = self.peak.seq
        for r in self._records:
            if r.alloc_seq <= seq and (r.free_seq is None or r.free_seq > seq):
                out[r.label] += r.nbytes
        return out

    def live_bytes(self, label: str | None = None) -> int:
        if label is None:
            return sum(self._by_label.values())
        return self._by_label[label]

    # -- module attribution ---------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> list:
        """Attribute forward allocations to the innermost named module; returns hook handles."""
        def enter(name: str) -> None:
            self._module_stack.append(name)

        def leave() -> None:
            self._module_stack.pop()

        handles = []
        for name, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: enter(name)))
            handles.append(mod.register_forward_hook(lambda m, a, o: leave()))
        return handles

    # -- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":  # a host read: see the module docstring
            value = 0 if _storage_key(args[0]) in self._found_inf else 1
            return float(value) if args[0].is_floating_point() else value
        if name == _UNSCALE:
            self._found_inf.add(_storage_key(args[1]))
        if name in _GEMMS and self.overheads.cublas_workspaces:
            self._cublas_workspace()
        workspace = None
        cls = self._workspace_class(name, args) if name in _CONVS else None
        fitted = cls is not None and self._fitted_workspaces(cls)
        if cls is not None:
            self.convolutions += 1
            workspace = None if fitted else self._cudnn_workspace(name, args)
        out = func(*args, **(kwargs or {}))
        if workspace is not None:
            self._free(workspace)
        if fitted:
            self._conv_outputs(name, args, out, cls)
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._watch(t, "temporary", name)
        return out

    def _workspace_class(self, name: str, args: tuple) -> str:
        x = args[1] if name == "convolution_backward" else args[0]
        return workspaces.workspace_class(x.dtype, self.tf32)

    @staticmethod
    def _fitted_workspaces(cls: str) -> bool:
        """Whether a convolution of workspace class ``cls`` takes its workspaces from the
        fitted model (:mod:`workspaces`): tensor-core calls always; true-fp32 ones where the
        model has fp32 ratios, and while a :func:`workspaces.recording` logs the calls (no
        model then)."""
        if cls in workspaces.TENSOR_CORE_CLASSES:
            return True
        model = workspaces.current_model()
        return model is None or model.has_class("fp32")

    def _conv_outputs(self, name: str, args: tuple, out, cls: str) -> None:
        """A convolution's outputs (workspace class ``cls``), each followed by its cuDNN
        call's transient workspace (:mod:`workspaces`: allocated after the output, freed when
        the call ends, as the H200 streams show; the backward's data call before its filter
        call)."""
        if name == "convolution":
            x, w, stride, outs = args[0], args[1], args[3], [(out, "forward")]
            layout = x.nbytes + out.nbytes + w.nbytes
        else:
            go, x, w, stride = args[0], args[1], args[2], args[4]
            outs = list(zip(out, ("backward_data", "backward_filter", None), strict=True))
            layout = go.nbytes + x.nbytes + w.nbytes
        model = workspaces.current_model() if self.overheads.cudnn_workspaces else None
        for t, call in outs:
            if t is None:
                continue
            conv = None if call is None else ConvCall.of(call, int(x.shape[1]), w.shape[2:],
                                                         stride, layout)
            if self._watch(t, "temporary", name, conv) and conv and model is not None:
                self._transient(model.workspace(cls, conv))

    def _transient(self, nbytes: int) -> None:
        """A workspace allocated and freed at once; PyTorch's cuDNN v8 path tries the next
        engine when it cannot be allocated (``aten/src/ATen/native/cudnn/Conv_v8.cpp``), so
        one that does not fit is skipped rather than causing the OOM."""
        if nbytes <= 0:
            return
        key = -1000 - self._seq  # not a storage: negative keys never collide with _cdata
        try:
            self._alloc(key, nbytes, "workspace", "cudnn")
        except SimulatedOutOfMemoryError:
            return
        self._free(key)

    def _cudnn_workspace(self, name: str, args: tuple) -> int | None:
        """cuDNN's convolution workspace, allocated through the caching allocator for the
        duration of the op. Sized as the explicit-GEMM algorithm's lowered input matrix
        (cuDNN docs, CUDNN_CONVOLUTION_FWD_ALGO_GEMM: the workspace holds the input as an
        (N*out_pixels) x (C_in/groups*kernel) matrix), the largest of the heuristic choices that
        still fit. PyTorch tries the next algorithm when a workspace cannot be allocated
        (``aten/src/ATen/native/cudnn/Conv_v8.cpp``), so a workspace never causes the OOM itself:
        one that does not fit is skipped.

        Only true-fp32 convolutions under a workspace model without fp32 ratios get this one;
        the others get the workspaces fitted on the H200 streams (:meth:`_conv_outputs`,
        :mod:`workspaces`)."""
        if not self.overheads.cudnn_workspaces or self.tf32:
            return None
        x = args[1] if name == "convolution_backward" else args[0]
        if x.dtype != torch.float32:
            return None
        if name == "convolution_backward":
            out, w = args[0], args[2]
            out_pixels = math.prod(int(d) for d in out.shape[2:])
        else:
            w, stride, padding, dilation = args[1], args[3], args[4], args[5]
            out_pixels = 1
            for i, (n, k) in enumerate(zip(x.shape[2:], w.shape[2:], strict=True)):
                s, p, d = (v[i] if len(v) > 1 else v[0] for v in (stride, padding, dilation))
                out_pixels *= max((int(n) + 2 * p - d * (int(k) - 1) - 1) // s + 1, 1)
        nbytes = int(x.shape[0]) * out_pixels * int(w[0].numel()) * x.element_size()
        if nbytes == 0:
            return None
        key = -1000 - self._seq  # not a storage: negative keys never collide with _cdata
        try:
            self._alloc(key, nbytes, "workspace", "cudnn")
        except SimulatedOutOfMemoryError:
            return None
        return key

    def _cublas_workspace(self) -> None:
        # One handle for the Python thread (setup/forward/loss/optimizer), one for the autograd
        # engine's device thread (backward).
        thread = "backward" if self.phase == "backward" else "main"
        if thread in self._workspace_phases or len(self._workspace_phases) >= \
                self.overheads.cublas_workspaces:
            return
        self._workspace_phases.add(thread)
        self._alloc(-1 - len(self._workspace_phases), self.overheads.cublas_workspace_bytes,
                    "workspace", "cublas")


class CudaDropout(TorchFunctionMode):
    """CUDA's dropout in the traced (CPU) step. On CUDA ``F.dropout`` in training with
    0 < p < 1 runs the fused ``native_dropout`` (``aten/src/ATen/native/Dropout.cpp``,
    ``is_fused_kernel_acceptable``), whose saved mask is bool (1 B per element); the CPU path
    draws its noise in the input dtype and saves that (4 B in fp32), which over-predicted
    every dropout layer of GPUMemNet's nets. In-place dropout takes the noise path on CUDA
    too, and p = 0 returns the input: both are left as they are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            names = ("input", "p", "training", "inplace")
            bound = dict(zip(names, args, strict=False)) | kwargs
            x, p = bound["input"], float(bound.get("p", 0.5))
            if (bound.get("training", True) and not bound.get("inplace", False)
                    and 0 < p < 1 and x.numel() > 0):
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)
