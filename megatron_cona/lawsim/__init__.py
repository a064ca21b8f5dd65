"""CONA at the paper's scale: a time-to-target simulator built on published training laws.

The SIMULATED part is training progress (Kaplan et al. 2020's loss law, McCandlish et al.
2018's critical-batch dynamics; every constant in :mod:`~megatron_cona.lawsim.constants`, with
its source); the clock is vTrain's measured A100 times or the project's time predictor. The
real CONA controller (:class:`~megatron_cona.session.ConaSession`) decides from simulated probe
readings and the clock, like every rival; an exact DP is the bound.

* :mod:`~megatron_cona.lawsim.constants` -- the one table of published constants;
* :mod:`~megatron_cona.lawsim.law` -- the law's state and dynamics (no torch);
* :mod:`~megatron_cona.lawsim.probe` -- what a real gradient probe would read;
* :mod:`~megatron_cona.lawsim.schedules` -- Megatron's ramp-up and Seesaw's batch schedule;
* :mod:`~megatron_cona.lawsim.bound` -- the exact DP bound;
* :mod:`~megatron_cona.lawsim.cases` -- model families, clocks, candidates, targets;
* :mod:`~megatron_cona.lawsim.chains` -- the chain registry and the runner;
* :mod:`~megatron_cona.lawsim.checks` -- sanity checks against published statements;
* :mod:`~megatron_cona.lawsim.evaluate` -- every case, the summary, ``sim.json``.
"""
