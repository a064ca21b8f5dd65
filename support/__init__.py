"""Support for the tests and the benchmarks, shared by both and not installed with the package:
the local model (``model``), `kvpool serve` servers (``serving``) and vLLM's scheduler and worker
connector driven by hand (``vllm_harness``)."""
