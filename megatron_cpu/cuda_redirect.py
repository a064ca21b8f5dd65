"""Run megatron-core on CPU by redirecting its hard-coded ``torch.cuda`` use.

megatron-core creates tensors with ``device="cuda"`` / ``torch.cuda.current_device()``, calls
``.cuda()``, and uses CUDA streams, events and the CUDA RNG.  :func:`install` makes all of that
land on the CPU so real GPTModel / DistributedDataParallel / DistributedOptimizer code can run on
gloo ranks without a GPU:

* a global :class:`TorchFunctionMode` rewrites every ``device`` that names CUDA to ``cpu``
  (factory kwargs, ``Tensor.to``/``Tensor.cuda``),
* ``torch.cuda`` streams, events, synchronize, nvtx and memory queries become no-ops,
* the CUDA RNG API is mapped onto the CPU generator (``model_parallel_cuda_manual_seed`` and the
  RNG tracker then fork CPU RNG states, which is what a CPU run needs).

The plugin (``megatron_cona``) never imports this module; the CPU launcher
(:mod:`megatron_cpu.launch`) installs it in every rank it starts.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.cuda, torch.Tensor.to) or getattr(func, "__name__", "") in (
            "cuda", "to"):
            name = getattr(func, "__name__", "")
            if name == "cuda":
                kwargs.pop("device", None)
                kwargs.pop("non_blocking", None)
                return args[0]
            if name == "to" and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts ``grad.type() == 'torch.cuda.FloatTensor'``
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return _NoEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoEvent(_NoStream):
    def record(self, *args, **kwargs) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class _RngWarningOnce(logging.Filter):
    """Megatron's RNG tracker warns when the CPU RNG moved inside a CUDA RNG fork; with the
    CUDA RNG mapped onto the CPU generator that is every fork (288 of a 12-iteration run's 307
    lines). Rank 0's first is kept, with why; the rest are dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if RNG_WARNING not in record.getMessage():
            return True
        if self.seen:
            return False
        self.seen = True
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return False  # rank 0 says it for all
        record.msg = (f"{RNG_WARNING} (expected on CPU: the CUDA RNG is redirected to the CPU "
                      "generator, so every RNG fork moves it; shown once, further ones dropped)")
        record.args = ()
        return True


def install() -> None:
    """Redirect CUDA use to CPU for the rest of this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|apex).*")
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_RngWarningOnce())
    _CudaToCpu().__enter__()  # stays active for the process lifetime

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NoStream
    cuda.Event = _NoEvent
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.default_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None,
                                      range_pop=lambda *a, **k: None,
                                      range=lambda *a, **k: contextlib.nullcontext())
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = (
        lambda state, *a, **k: torch.set_rng_state(state))
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
