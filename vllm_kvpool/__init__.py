"""Unified KV pool: one logical KV-cache pool over host-memory pools and SSDs, as a vLLM connector.

Importing the package is cheap: neither vLLM nor the C++ I/O engine (``vllm_kvpool._kvio``) is
imported here, so ``import vllm_kvpool`` and the pure-logic modules work without either.
"""

from vllm_kvpool.config import PoolConfig, PoolConfigError, load_pool_config

__all__ = ["PoolConfig", "PoolConfigError", "load_pool_config", "__version__"]
__version__ = "0.1.0"
