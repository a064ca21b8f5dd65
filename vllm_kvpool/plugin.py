"""vLLM ``general_plugins`` entry point: makes ``"kv_connector": "UnifiedKVPoolConnector"`` work
without ``kv_connector_module_path`` once the package is installed."""

from __future__ import annotations

CONNECTOR_NAME = "UnifiedKVPoolConnector"
CONNECTOR_MODULE = "vllm_kvpool.connector"


def register() -> None:
    """Register the connector with vLLM's factory; safe to call any number of times."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # registered concurrently / by an older vLLM without _registry
        pass
