"""CONA: online parallelism-strategy chaining for Megatron-Core training.

Kept light on purpose: importing the package pulls in neither torch.distributed state nor
megatron-core.  The pieces: :mod:`megatron_cona.runtime` (a training state for one strategy),
:mod:`megatron_cona.parallel` (its process groups) and :mod:`megatron_cona.reshard` (the
checkpoint-free switch between strategies)."""

__version__ = "0.1.0"
