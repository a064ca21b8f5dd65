"""Run megatron-core on CPU-only machines: gloo ranks (:mod:`megatron_cpu.launch`) and the
redirect of megatron-core's hard-coded ``torch.cuda`` calls (:mod:`megatron_cpu.cuda_redirect`).

Used by the tests, the benchmarks and ``scripts/cona_cpu.py``. It is not part of the installed
plugins: ``megatron_cona`` never imports it, so a GPU run never carries the redirect."""
