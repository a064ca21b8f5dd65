"""GPU validation kit: one prepared command that turns a lent GPU into ground truth.

Not part of the shipped plugins (``setup.py`` packages only ``vllm_kvpool``, ``megatron_cona``
and ``predictors``). Entry point: ``scripts/gpu_check.py`` (``make gpu-check``); what it measures,
the files it writes and how to fold them into ``predictors/data/``: ``docs/gpu-check.md``.

Layout: :mod:`gpucheck.harness` runs each part in its own process under a time budget and writes
``run.json`` + ``log.txt``; :mod:`gpucheck.common` holds provenance, budgets and the row writer;
:mod:`gpucheck.schema` validates every result file; :mod:`gpucheck.adapters` is the ONE place that
calls the product APIs; :mod:`gpucheck.carry` unpacks the carried wheels and ``.deb`` files.
"""
