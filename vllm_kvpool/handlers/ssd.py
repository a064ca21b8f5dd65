"""The ``ssd`` medium: a file, a block device or an SPDK namespace, chosen by ``backend``.

Its entry's own fields: ``path`` (the block device, or the file to preallocate; required),
``backend`` (``uring`` | ``posix`` | ``spdk``), ``spdk_trid`` (the namespace's transport id,
required for spdk), ``spdk_core_mask`` (the SPDK poller's CPUs) and ``queue_depth``. Chunks on a
file or block device survive a restart (``DeviceHandler.restorable``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvpool.config import DeviceConfig, PoolConfig, PoolConfigError, choice_field, int_field
from vllm_kvpool.handlers.device import DeviceHandler, ssd_settings
from vllm_kvpool.handlers.spdk import SpdkHandler
from vllm_kvpool.layout import ChunkLayout
from vllm_kvpool.media import Medium, MediumSettings, register_medium
from vllm_kvpool.persist import RestoredChunk

# backend -> handler; uring and posix differ only inside _kvio.Device
BACKENDS: dict[str, type[DeviceHandler]] = {"uring": DeviceHandler, "posix": DeviceHandler,
                                            "spdk": SpdkHandler}  # fmt: skip
_CORE_MASK = re.compile(r"0[xX][0-9a-fA-F]+|\[?\d+(-\d+)?(,\d+(-\d+)?)*\]?")


@dataclass(frozen=True)
class SsdSettings(MediumSettings):
    path: str
    backend: str = "uring"
    spdk_trid: str | None = None
    spdk_core_mask: str | None = None  # CPUs of the SPDK poller (None: KVPOOL_SPDK_CORE_MASK)
    queue_depth: int = 32

    @classmethod
    def parse(cls, body: Mapping[str, Any], where: str) -> SsdSettings:
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise PoolConfigError(f"{where}.path",
                                  "missing (a block device or a file to preallocate)")  # fmt: skip
        backend = choice_field(body, "backend", "uring", tuple(BACKENDS), where)
        trid = body.get("spdk_trid")
        if backend == "spdk" and not trid:
            raise PoolConfigError(f"{where}.spdk_trid", "required when backend is spdk")
        if trid is not None and not isinstance(trid, str):
            raise PoolConfigError(f"{where}.spdk_trid",
                                  f"expected a transport id string, got {trid!r}")  # fmt: skip
        mask = body.get("spdk_core_mask")
        if mask is not None and (backend != "spdk" or not isinstance(mask, str)
                                 or not _CORE_MASK.fullmatch(mask.replace(" ", ""))):  # fmt: skip
            raise PoolConfigError(f"{where}.spdk_core_mask",
                                  f"expected a CPU mask ('0x4') or list ('2', '2-3') for backend "
                                  f"spdk, got {mask!r}")  # fmt: skip
        settings = cls(path, backend, trid, mask,
                       int_field(body, "queue_depth", 32, where, minimum=1))  # fmt: skip
        if settings.opens_path and not Path(path).exists() and not Path(path).parent.is_dir():
            raise PoolConfigError(f"{where}.path", f"neither {path} nor its directory exists")
        if settings.opens_path and Path(path).is_dir():  # the engine opens only a file or device
            raise PoolConfigError(f"{where}.path", f"{path} is a directory: name a file in it "
                                                   "(created and preallocated) or a block device")
        return settings

    @property
    def opens_path(self) -> bool:
        """Whether ``path`` is what is opened (SPDK opens ``spdk_trid``; its path is a label)."""
        return self.backend != "spdk"

    def unique_fields(self) -> dict[str, Any]:
        return {"path": self.path} if self.opens_path else {}


class SsdMedium(Medium):
    name = "ssd"
    settings = SsdSettings

    def open(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout,
             rank_suffix: str) -> DeviceHandler:  # fmt: skip
        return BACKENDS[ssd_settings(cfg).backend](cfg, layout, config.staging, rank_suffix)

    def probe(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout) -> float:
        return BACKENDS[ssd_settings(cfg).backend].probe_gbps(cfg, layout, config.probe.seconds)

    def restore(self, cfg: DeviceConfig, layout: ChunkLayout,
                world_size: int) -> list[RestoredChunk]:  # fmt: skip
        return BACKENDS[ssd_settings(cfg).backend].restorable(cfg, layout, world_size)

    def describe(self, cfg: DeviceConfig) -> tuple[str, str]:
        settings = ssd_settings(cfg)
        return f"ssd/{settings.backend}", settings.path


register_medium(SsdMedium())
