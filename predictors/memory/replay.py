"""Replay the analytical step as a tensor-level allocation stream through the allocator simulator.

The factorization knows per-layer totals; here each total becomes tensors (a layer's parameters
as its real parameter tensors, its saved activations as the tensors the factorization lists,
else chunks of its largest tensor) allocated and freed in step order, twice (the first step creates the Adam states), so
the caching allocator's segment rules and block reuse act on realistic sizes. The second step's
reserved peak is the base the residual model multiplies (and a feature)."""

from __future__ import annotations

from .allocator import CachingAllocatorSim
from .config import Step
from .factorize import F32, Factorization, LayerMemory
from .overheads import CudaOverheads
from .phases import deepspeed_zero, trainable_tensors
from .zero import deepspeed_step


def _param_tensors(layer: LayerMemory) -> list[int]:
    """The layer's parameter tensors in bytes (their real shapes, so gradients and Adam states
    reuse the holes activations leave the way the real step's do)."""
    if layer.tensor_bytes:  # quantized weights: bytes per tensor as stored
        return list(layer.tensor_bytes)
    width = layer.param_bytes // max(layer.params, 1)
    return [n * width for n in layer.tensor_params] or [layer.param_bytes]


def _chunks(total: int, largest: int) -> list[int]:
    if total <= 0:
        return []
    if largest <= 0:
        return [total]
    n = max(total // largest, 1)
    return [total // n] * n


def _shard(sizes: list[int], degree: int) -> list[int]:
    return [-(-s // degree) for s in sizes]


def replay_reserved(fz: Factorization, cfg: Step, overheads: CudaOverheads) -> int:
    """Reserved peak of the replayed steady-state (second) step on one rank. ZeRO stage 1
    shards fp32 masters and Adam states over ``dp``, stage 2 also gradients, stage 3 also
    parameters (each layer's full parameters gathered around its forward and backward)."""
    p = cfg.precision
    sim = CachingAllocatorSim()
    ratio = (F32 / max(p.param_dtype.itemsize, 1))
    opt_dp = cfg.dp if cfg.zero >= 1 else 1
    grad_dp = cfg.dp if cfg.zero >= 2 else 1
    gather = cfg.zero >= 3 and cfg.dp > 1
    full = {i: _param_tensors(x) for i, x in enumerate(fz.layers)}
    params = {i: _shard(v, opt_dp) for i, v in full.items()}  # what masters/states shard to
    for sizes in full.values():
        for s in _shard(sizes, cfg.dp) if gather else sizes:
            sim.malloc(s)

    def gathered(i: int) -> list[int]:
        return [sim.malloc(s) for s in full[i]] if gather else []
    trained = [i for i, x in enumerate(fz.layers) if x.trainable]
    # DeepSpeed ZeRO 2/3: gradient partitions in one flat buffer for the run, each layer's
    # full gradients transient until reduce-scattered into it, the step one sub-group at a time
    ds = (deepspeed_step(trainable_tensors(fz), cfg.dp, cfg.zero, p.param_dtype.itemsize,
                         cfg.options.foreach_temporaries)
          if deepspeed_zero(cfg) else None)
    if ds is not None:
        sim.malloc(ds.grad_buffer)
    if p.master_weights_fp32:
        for i in trained:
            for s in params[i]:
                sim.malloc(int(s * ratio))
    states: list[int] = []
    workspaces = 0
    for step in range(2):
        if step == 1:
            sim.reset_peak()
        inputs = sim.malloc(fz.input_bytes) if fz.input_bytes else None
        if workspaces == 0 and overheads.cublas_workspaces:
            sim.malloc(overheads.cublas_workspace_bytes)
            workspaces = 1
        saved: list[list[int]] = []
        for i, x in enumerate(fz.layers):
            weights = gathered(i)
            sizes = x.saved_tensors or _chunks(x.saved, x.largest)
            saved.append([sim.malloc(c) for c in sizes])
            if x.largest:
                sim.free(sim.malloc(x.largest))
            for h in weights:
                sim.free(h)
        held = sim.malloc(fz.held_output) if fz.held_output else None
        loss = [sim.malloc(c) for c in _chunks(fz.loss_saved - fz.held_output, 0)]
        if fz.loss_transient:
            sim.free(sim.malloc(fz.loss_transient // 2))
        if workspaces == 1 and overheads.cublas_workspaces > 1:
            sim.malloc(overheads.cublas_workspace_bytes)
            workspaces = 2
        dlogits = sim.malloc(fz.loss_transient // 2) if fz.loss_transient else None
        for h in loss:
            sim.free(h)
        grads: dict[int, list[int]] = {}
        for i in range(len(fz.layers) - 1, -1, -1):
            x = fz.layers[i]
            weights = gathered(i)
            tmp = [sim.malloc(x.largest), sim.malloc(x.largest)] if x.largest else []
            if x.trainable and ds is not None:
                tmp += [sim.malloc(s) for s in full[i]]
            elif x.trainable:
                grads[i] = [sim.malloc(s) for s in _shard(full[i], grad_dp)]
            for h in tmp + saved[i] + weights:
                sim.free(h)
            if dlogits is not None and i == len(fz.layers) - 1:
                sim.free(dlogits)
        if ds is not None:
            w = p.param_dtype.itemsize
            for n in ds.groups:
                flat = sim.malloc(n * w)
                fp32_grad = sim.malloc(n * F32)
                sim.free(flat)
                temps = [sim.malloc(n * F32) for _ in range(ds.optimizer_temporaries)]
                for h in temps + [fp32_grad]:
                    sim.free(h)
        elif p.master_weights_fp32:
            for i in trained:
                for k, s in enumerate(_shard(full[i], grad_dp)):
                    new = sim.malloc(int(s * ratio))
                    sim.free(grads[i][k])
                    grads[i][k] = new
        if step == 0:
            state_scale = ratio if p.master_weights_fp32 else 1.0
            for i in trained:
                for s in params[i]:
                    states += [sim.malloc(512), sim.malloc(int(s * state_scale)),
                               sim.malloc(int(s * state_scale))]
        for hs in grads.values():
            for h in hs:
                sim.free(h)
        if held is not None:
            sim.free(held)
        if inputs is not None:
            sim.free(inputs)
    return sim.stats.peak_reserved
