"""Pool configuration: parse YAML / JSON / dict into validated dataclasses.

Every error is a ``PoolConfigError`` whose message starts with the dotted path of the offending
field (``devices[1].ssd.backend: ...``), raised before vLLM allocates anything or serves.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PlacementPolicy = Literal["bandwidth", "round_robin", "single_tier_serial"]
Backend = Literal["uring", "spdk", "posix"]
PLACEMENT_POLICIES: tuple[str, ...] = ("bandwidth", "round_robin", "single_tier_serial")
BACKENDS: tuple[str, ...] = ("uring", "spdk", "posix")
LOAD_MODES: tuple[str, ...] = ("async", "sync")
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class PoolConfigError(ValueError):
    """A malformed pool config; the message names the field."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"kvpool config: {field_path}: {problem}")
        self.field = field_path


def parse_size(value: Any, field_path: str) -> int:
    """``"8GiB"``, ``"512MB"``, ``1048576`` -> bytes (> 0)."""
    if isinstance(value, bool):
        raise PoolConfigError(field_path, f"expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise PoolConfigError(field_path, f"unknown size unit {m.group(2)!r} in {value!r}")
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise PoolConfigError(field_path, f"expected a size like '8GiB', got {value!r}")
    if size <= 0:
        raise PoolConfigError(field_path, f"must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class DeviceConfig:
    """One member of the pool: a host-memory pool on a NUMA node, or an SSD (file / block dev)."""

    kind: Literal["host", "ssd"]
    name: str
    capacity: int  # bytes the pool may use on this device
    numa_node: int = 0  # host: where the pool lives; ssd: where its staging buffers live
    path: str | None = None
    backend: Backend = "uring"
    spdk_trid: str | None = None
    spdk_core_mask: str | None = None  # CPUs of the SPDK poller (None: KVPOOL_SPDK_CORE_MASK)
    queue_depth: int = 32
    bandwidth_gbps: float | None = None  # fixed placement weight; skips the probe


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = True
    seconds: float = 0.5  # per device
    size: int = 64 * 2**20  # bytes moved per probe pass
    drift_threshold: float = 0.3  # re-weight when observed GB/s moves by more than this fraction


@dataclass(frozen=True)
class PoolConfig:
    devices: tuple[DeviceConfig, ...]
    chunk_tokens: int = 256
    placement: PlacementPolicy = "bandwidth"
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    load_mode: Literal["async", "sync"] = "async"
    load_failure: Literal["recompute", "fail"] = "recompute"
    # Bytes read from an SSD are always verified; a host-memory chunk is verified when saved
    # and, with this on, again on every fetch (costs a hash pass over the host share).
    verify_checksums: bool = False
    copy_threads: int = 0  # memcpy threads of a fetch's host copy; 0: from the probe
    save_decode: bool = True  # also save chunks of generated tokens (multi-turn reuse)
    staging: int = 256 * 2**20  # bytes of host staging per SSD device (reads in flight)
    device_retry_seconds: float = 10.0  # a failed device is reopened and checked this often

    @property
    def hosts(self) -> tuple[DeviceConfig, ...]:
        return tuple(d for d in self.devices if d.kind == "host")

    @property
    def ssds(self) -> tuple[DeviceConfig, ...]:
        return tuple(d for d in self.devices if d.kind == "ssd")

    def check_block_size(self, block_size: int) -> int:
        """Validate chunk_tokens against vLLM's block size; returns blocks per chunk."""
        if self.chunk_tokens % block_size:
            raise PoolConfigError(
                "chunk_tokens",
                f"{self.chunk_tokens} is not a multiple of vLLM's block_size {block_size}",
            )
        return self.chunk_tokens // block_size

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain-dict form (round-trips through ``load_pool_config``)."""
        devices = []
        for d in self.devices:
            body: dict[str, Any] = {"name": d.name, "capacity": d.capacity}
            if d.kind == "host":
                body["numa_node"] = d.numa_node
            else:
                body.update(path=d.path, backend=d.backend, numa_node=d.numa_node,
                            queue_depth=d.queue_depth)  # fmt: skip
                if d.spdk_trid:
                    body["spdk_trid"] = d.spdk_trid
                if d.spdk_core_mask:
                    body["spdk_core_mask"] = d.spdk_core_mask
            if d.bandwidth_gbps is not None:
                body["bandwidth_gbps"] = d.bandwidth_gbps
            devices.append({d.kind: body})
        return {
            "devices": devices,
            "chunk_tokens": self.chunk_tokens,
            "placement": self.placement,
            "probe": vars(self.probe).copy(),
            "load_mode": self.load_mode,
            "load_failure": self.load_failure,
            "verify_checksums": self.verify_checksums,
            "copy_threads": self.copy_threads,
            "save_decode": self.save_decode,
            "staging": self.staging,
            "device_retry_seconds": self.device_retry_seconds,
        }


def _check_keys(obj: Any, allowed: set[str], field_path: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise PoolConfigError(field_path, f"expected a mapping, got {type(obj).__name__}")
    for key in obj:
        if key not in allowed:
            raise PoolConfigError(
                f"{field_path}.{key}" if field_path else str(key),
                f"unknown field (allowed: {', '.join(sorted(allowed))})",
            )
    return obj


def _int(obj: dict, key: str, default: int, field_path: str, minimum: int = 0) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."), f"expected an integer >= {minimum}, "
                                                     f"got {value!r}")  # fmt: skip
    return value


def _bool(obj: dict, key: str, default: bool, field_path: str) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."), f"expected true/false, got {value!r}")
    return value


def _float(obj: dict, key: str, default: float | None, field_path: str) -> float | None:
    value = obj.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."),
                              f"expected a positive number, got {value!r}")  # fmt: skip
    return float(value)


def _choice(obj: dict, key: str, default: str, choices: tuple[str, ...], field_path: str) -> str:
    value = obj.get(key, default)
    if value not in choices:
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."),
                              f"{value!r} is not one of {', '.join(choices)}")  # fmt: skip
    return value


_HOST_KEYS = {"name", "numa_node", "capacity", "bandwidth_gbps"}
_SSD_KEYS = {"name", "path", "capacity", "backend", "spdk_trid", "spdk_core_mask", "numa_node",
             "queue_depth", "bandwidth_gbps"}  # fmt: skip
_CORE_MASK = re.compile(r"0[xX][0-9a-fA-F]+|\[?\d+(-\d+)?(,\d+(-\d+)?)*\]?")


def _parse_device(entry: Any, index: int) -> DeviceConfig:
    where = f"devices[{index}]"
    if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in ("host", "ssd"):
        raise PoolConfigError(where, "each device is a one-key mapping: {host: {...}} or {ssd: {...}}")
    kind, body = next(iter(entry.items()))
    where = f"{where}.{kind}"
    body = _check_keys(body, _HOST_KEYS if kind == "host" else _SSD_KEYS, where)
    if "capacity" not in body:
        raise PoolConfigError(f"{where}.capacity", "missing")
    capacity = parse_size(body["capacity"], f"{where}.capacity")
    numa_node = _int(body, "numa_node", 0, where)
    bandwidth = _float(body, "bandwidth_gbps", None, where)
    name = body.get("name", "")
    if not isinstance(name, str):
        raise PoolConfigError(f"{where}.name", f"expected a string, got {name!r}")
    if kind == "host":
        return DeviceConfig("host", name, capacity, numa_node=numa_node, bandwidth_gbps=bandwidth)
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise PoolConfigError(f"{where}.path", "missing (a block device or a file to preallocate)")
    backend = _choice(body, "backend", "uring", BACKENDS, where)
    trid = body.get("spdk_trid")
    if backend == "spdk" and not trid:
        raise PoolConfigError(f"{where}.spdk_trid", "required when backend is spdk")
    if trid is not None and not isinstance(trid, str):
        raise PoolConfigError(f"{where}.spdk_trid", f"expected a transport id string, got {trid!r}")
    mask = body.get("spdk_core_mask")
    if mask is not None and (backend != "spdk" or not isinstance(mask, str)
                             or not _CORE_MASK.fullmatch(mask.replace(" ", ""))):  # fmt: skip
        raise PoolConfigError(f"{where}.spdk_core_mask",
                              f"expected a CPU mask ('0x4') or list ('2', '2-3') for backend spdk, "
                              f"got {mask!r}")  # fmt: skip
    if backend != "spdk" and not Path(path).exists() and not Path(path).parent.is_dir():
        raise PoolConfigError(f"{where}.path", f"neither {path} nor its directory exists")
    return DeviceConfig(
        "ssd", name, capacity, numa_node=numa_node, path=path, backend=backend, spdk_trid=trid,
        spdk_core_mask=mask,
        queue_depth=_int(body, "queue_depth", 32, where, minimum=1), bandwidth_gbps=bandwidth,
    )  # fmt: skip


def _name_devices(devices: list[DeviceConfig]) -> tuple[DeviceConfig, ...]:
    counts = {"host": 0, "ssd": 0}
    named, seen = [], set()
    for i, d in enumerate(devices):
        name = d.name or f"{d.kind}{counts[d.kind]}"
        counts[d.kind] += 1
        if name in seen:
            raise PoolConfigError(f"devices[{i}].{d.kind}.name", f"duplicate device name {name!r}")
        seen.add(name)
        named.append(DeviceConfig(**{**vars(d), "name": name}))
    paths = [d.path for d in named if d.kind == "ssd" and d.backend != "spdk"]
    for i, d in enumerate(named):
        if d.kind == "ssd" and d.backend != "spdk" and paths.count(d.path) > 1:
            raise PoolConfigError(f"devices[{i}].ssd.path", f"{d.path} is listed twice")
    return tuple(named)


_TOP_KEYS = {"devices", "chunk_tokens", "placement", "probe", "load_mode", "load_failure",
             "verify_checksums", "copy_threads", "save_decode", "staging",
             "device_retry_seconds"}  # fmt: skip
_PROBE_KEYS = {"enabled", "seconds", "size", "drift_threshold"}


def parse_pool_config(raw: Any) -> PoolConfig:
    """Validate a plain mapping (the parsed YAML/JSON) into a ``PoolConfig``."""
    raw = _check_keys(raw, _TOP_KEYS, "")
    devices_raw = raw.get("devices")
    if not isinstance(devices_raw, list) or not devices_raw:
        raise PoolConfigError("devices", "expected a non-empty list of {host: ...} / {ssd: ...}")
    devices = _name_devices([_parse_device(d, i) for i, d in enumerate(devices_raw)])
    probe_raw = _check_keys(raw.get("probe", {}), _PROBE_KEYS, "probe")
    drift = _float(probe_raw, "drift_threshold", 0.3, "probe")
    probe = ProbeConfig(
        enabled=_bool(probe_raw, "enabled", True, "probe"),
        seconds=_float(probe_raw, "seconds", 0.5, "probe"),
        size=parse_size(probe_raw.get("size", 64 * 2**20), "probe.size"),
        drift_threshold=drift,
    )
    return PoolConfig(
        devices=devices,
        chunk_tokens=_int(raw, "chunk_tokens", 256, "", minimum=1),
        placement=_choice(raw, "placement", "bandwidth", PLACEMENT_POLICIES, ""),
        probe=probe,
        load_mode=_choice(raw, "load_mode", "async", LOAD_MODES, ""),
        load_failure=_choice(raw, "load_failure", "recompute", LOAD_FAILURE_POLICIES, ""),
        verify_checksums=_bool(raw, "verify_checksums", False, ""),
        copy_threads=_int(raw, "copy_threads", 0, "", minimum=0),
        save_decode=_bool(raw, "save_decode", True, ""),
        staging=parse_size(raw.get("staging", 256 * 2**20), "staging"),
        device_retry_seconds=_float(raw, "device_retry_seconds", 10.0, ""),
    )


def _parse_text(text: str, origin: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PoolConfigError(origin, f"neither valid JSON nor YAML: {exc}") from None


def load_pool_config(source: str | os.PathLike | dict[str, Any] | PoolConfig) -> PoolConfig:
    """Load from a dict, an inline JSON/YAML string, or a path to a .yaml/.yml/.json file."""
    if isinstance(source, PoolConfig):
        return source
    if isinstance(source, dict):
        return parse_pool_config(source)
    if not isinstance(source, str | os.PathLike):
        raise PoolConfigError("pool", f"expected a path, inline JSON or a mapping, got {source!r}")
    text = os.fspath(source)
    if text.lstrip().startswith(("{", "[")) or "\n" in text:
        return parse_pool_config(_parse_text(text, "pool"))
    path = Path(text)
    if not path.is_file():
        raise PoolConfigError("pool", f"config file {text} does not exist")
    return parse_pool_config(_parse_text(path.read_text(), f"pool ({text})"))


def pool_config_from_extra(extra: dict[str, Any] | None) -> PoolConfig:
    """The pool config from vLLM's ``kv_connector_extra_config``.

    Either ``{"pool": <path | inline JSON | mapping>}`` or the pool mapping itself inline.
    """
    extra = extra or {}
    if "pool" in extra:
        try:
            return load_pool_config(extra["pool"])
        except PoolConfigError as exc:
            if exc.field == "pool" or exc.field.startswith("pool "):
                raise PoolConfigError(f"kv_connector_extra_config.{exc.field}",
                                      str(exc).split(": ", 2)[-1]) from None  # fmt: skip
            raise
    if "devices" in extra:
        return parse_pool_config(extra)
    raise PoolConfigError(
        "kv_connector_extra_config.pool",
        "missing: give a YAML/JSON file path, inline JSON, or the pool mapping itself",
    )
