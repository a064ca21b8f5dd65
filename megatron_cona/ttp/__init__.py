"""Time-to-perplexity (TTP) evaluation of CONA: SIMULATED clock, REAL training progress.

Modules:

* :mod:`~megatron_cona.ttp.clock` -- the simulated cluster clock (vTrain-measured iteration times
  of GPT-3 1.3B on 8x A100, reshard-plan switch costs) and CONA's held-out time predictor;
* :mod:`~megatron_cona.ttp.curves` -- real training curves of small megatron-core models, cached
  by provenance (code hash, engine versions, model, seed, schedule, batch, LR);
* :mod:`~megatron_cona.ttp.stitch` -- the per-batch curves stitched with the loss as the state;
* :mod:`~megatron_cona.ttp.bound` -- the DP over (global batch x layout) sequences: a true bound;
* :mod:`~megatron_cona.ttp.chains` -- chains replayed on the stitched curves and the clock;
* :mod:`~megatron_cona.ttp.baselines` -- the :class:`Baseline` registry (planner, tuned static,
  Megatron ramp-up, CONA, the bound; Pollux registers from ``benchmarks/``);
* :mod:`~megatron_cona.ttp.evaluate` -- building the curve set and running every case.

Engine-heavy modules load on first use, so importing the package stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TTPOptions": "evaluate", "run_ttp": "evaluate", "result_line": "evaluate",
    "summarize": "evaluate", "model_spec": "evaluate",
    "Baseline": "baselines", "BASELINES": "baselines", "register": "baselines",
    "CaseInputs": "baselines",
    "ChainResult": "chains", "TTPError": "chains",
    "dp_bound": "bound", "CurveSet": "stitch",
    "Curve": "curves", "CurveCache": "curves", "cache_key": "curves", "code_hash": "curves",
    "exec_strategy": "curves",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
