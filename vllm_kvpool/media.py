"""Pool media registered by name, as vLLM registers its offloading specs.

A device entry of the pool config is ``{<medium name>: {...}}``. Its medium parses the entry's
own fields (``Medium.settings``; the common ones, ``name``, ``capacity``, ``numa_node``,
``bandwidth_gbps``, are parsed once by ``config``), opens the device on the worker, probes its
read bandwidth for the placement weights, and lists the chunks a previous run left on it.
A new medium is one ``Medium`` subclass and a ``register_medium`` call before its config is
parsed; nothing else dispatches on the medium.

The built-in media, ``host`` (``handlers.host``) and ``ssd`` (``handlers.ssd``), register
themselves when ``vllm_kvpool.handlers`` is imported, which the first lookup does.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from vllm_kvpool.config import DeviceConfig, PoolConfig
    from vllm_kvpool.handlers.base import MediumHandler
    from vllm_kvpool.layout import ChunkLayout
    from vllm_kvpool.persist import RestoredChunk


@dataclass(frozen=True)
class MediumSettings:
    """A medium's own fields of a device entry; each dataclass field is an allowed config key
    (the medium's schema). A medium without fields of its own uses this class as is."""

    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def parse(cls, body: Mapping[str, Any], where: str) -> MediumSettings:
        """Validate the entry's own fields (only ``keys()`` reach here); errors are
        ``PoolConfigError(f"{where}.<key>", ...)``."""
        return cls(**body)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a config entry writes them (unset optional ones left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def unique_fields(self) -> dict[str, Any]:
        """Fields whose values no two devices of this medium may share (a file, say)."""
        return {}


class Medium(ABC):
    """One kind of pool member, registered under ``name`` (its config key)."""

    name: ClassVar[str]
    settings: ClassVar[type[MediumSettings]] = MediumSettings

    @abstractmethod
    def open(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout,
             rank_suffix: str) -> MediumHandler:  # fmt: skip
        """The worker's handler of the device (``rank_suffix``: this rank's, e.g. ".rank1")."""

    @abstractmethod
    def probe(self, cfg: DeviceConfig, config: PoolConfig, layout: ChunkLayout) -> float:
        """Read bandwidth in GB/s (a placement weight), measured within ``config.probe``."""

    def restore(self, cfg: DeviceConfig, layout: ChunkLayout,
                world_size: int) -> list[RestoredChunk]:  # fmt: skip
        """Chunks a previous run left that this pool may serve; none unless persistent."""
        return []

    def describe(self, cfg: DeviceConfig) -> tuple[str, str]:
        """(kind, where) for ``kvpool probe``'s table."""
        return cfg.kind, f"numa {cfg.numa_node}"


COMMON_FIELDS = frozenset({"name", "capacity", "numa_node", "bandwidth_gbps"})  # every medium's
_MEDIA: dict[str, Medium] = {}
_BUILTINS = "vllm_kvpool.handlers"  # its import registers host and ssd


def register_medium(medium: Medium) -> None:
    """Make ``medium`` the meaning of its name in device entries."""
    if medium.name in media():
        raise ValueError(f"kvpool: medium {medium.name!r} is already registered")
    if clash := COMMON_FIELDS & medium.settings.keys():
        raise ValueError(f"kvpool: medium {medium.name!r} redefines the common fields "
                         f"{', '.join(sorted(clash))}")  # fmt: skip
    _MEDIA[medium.name] = medium


def unregister_medium(name: str) -> None:
    """Forget a medium registered with ``register_medium`` (tests, plugins unloading)."""
    del _MEDIA[name]


def media() -> Mapping[str, Medium]:
    """Every registered medium by name, the built-ins included."""
    importlib.import_module(_BUILTINS)
    return MappingProxyType(_MEDIA)


def medium_of(cfg: DeviceConfig) -> Medium:
    """The medium a parsed device entry names."""
    return media()[cfg.kind]
