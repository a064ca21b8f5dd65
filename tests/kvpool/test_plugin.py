"""The vllm.general_plugins entry point registers the short connector name, idempotently."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_register_is_idempotent_and_resolves_short_name():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_kvpool.plugin import register

    register()
    register()  # a second call (vLLM loads plugins in every process) must not raise
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="UnifiedKVPoolConnector", kv_role="kv_both"))
    from vllm_kvpool.connector import UnifiedKVPoolConnector

    assert cls is UnifiedKVPoolConnector
    assert cls.get_required_kvcache_layout(None) is None  # any layout vLLM picks works


def test_package_import_is_light():
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, vllm_kvpool, vllm_kvpool.placement, vllm_kvpool.pool; "
            "assert 'vllm' not in sys.modules and 'vllm_kvpool._kvio' not in sys.modules")
    repo = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo,
                   env={**os.environ, "PYTHONPATH": repo})
