"""Optimizer state beyond the per-element tensors: what Adam keeps, its step count, the fp16
grad scaler and the LR scheduler.

The per-element tensors (fp32 main weights, ``exp_avg``, ``exp_avg_sq``) are moved by the plan
like weights (see :mod:`megatron_cona.reshard.layout`).  Before that, the destination optimizer
gets zero-filled state of the right kinds and step count (:func:`init_optimizer_state`; Adam
otherwise creates it lazily at its first step), and afterwards the scalar state is copied
(:func:`copy_scalar_state`): it is identical on every rank, so no communication is needed.
"""

from __future__ import annotations

import torch

from megatron_cona.reshard import layout
from megatron_cona.reshard.state import ModelOptimizerSet


def adam_kinds(state: ModelOptimizerSet) -> tuple[list[str], float | None, bool]:
    """Tensor-valued Adam state keys, the step count held by this rank (None: no state yet) and
    whether the optimizer keeps ``step`` in its param groups (TE/apex FusedAdam)."""
    kinds: set[str] = set()
    step, in_groups = None, False
    for opt, st in layout.inner_optimizer_states(state):
        for group in opt.param_groups:
            if "step" in group:
                in_groups, step = True, max(step or 0.0, float(group["step"]))
        for values in st.values():
            for key, value in values.items():
                if key == "step":
                    step = max(step or 0.0, float(value))
                elif torch.is_tensor(value) and value.dim() > 0:
                    kinds.add(key)
    return sorted(kinds), step, in_groups


def init_optimizer_state(state: ModelOptimizerSet, kinds: list[str], step: float | None,
                          step_in_groups: bool) -> None:
    """Create zero Adam state (overwritten by the transfer) with ``step`` steps done."""
    if step is None:
        return  # the source has not stepped yet: Adam initializes lazily on both sides
    for opt, st in layout.inner_optimizer_states(state):
        for group in opt.param_groups:
            if step_in_groups:
                group["step"] = int(step)
            for p in group["params"]:
                entry = st.setdefault(p, {})
                if not step_in_groups:
                    entry["step"] = torch.tensor(float(step), dtype=torch.float32)
                for kind in kinds:
                    entry.setdefault(kind, torch.zeros_like(p.data))


def copy_scalar_state(old: ModelOptimizerSet, new: ModelOptimizerSet) -> None:
    old_opts = layout.megatron_optimizers(old)
    new_opts = layout.megatron_optimizers(new)
    for o, n in zip(old_opts, new_opts, strict=True):
        scaler_old, scaler_new = getattr(o, "grad_scaler", None), getattr(n, "grad_scaler", None)
        if scaler_old is not None and scaler_new is not None:
            scaler_new.load_state_dict(scaler_old.state_dict())
    src, dst = old.scheduler, new.scheduler
    for name in ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                 "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
                 "wsd_decay_steps", "lr_wsd_decay_style", "num_steps"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
    dst.step(increment=0)  # push the current LR / WD into the new optimizer's param groups
