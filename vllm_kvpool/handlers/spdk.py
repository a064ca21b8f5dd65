"""SPDK medium: an NVMe namespace driven from user space (``_kvio.Device`` backend ``spdk``).

The same transfers as a file or block device; it differs in what is opened (the transport id,
``spdk_trid``, not a path) and in that ranks cannot keep per-rank files on it.
"""

from __future__ import annotations

from vllm_kvpool.config import DeviceConfig
from vllm_kvpool.handlers.device import DeviceHandler


class SpdkHandler(DeviceHandler):
    @classmethod
    def target_of(cls, cfg: DeviceConfig, rank_suffix: str = "") -> str:
        assert cfg.spdk_trid is not None  # the config parser requires it for spdk
        return cfg.spdk_trid
