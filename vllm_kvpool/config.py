"""Pool configuration: parse YAML / JSON / dict into validated dataclasses.

Every error is a ``PoolConfigError`` whose message starts with the dotted path of the offending
field (``devices[1].ssd.backend: ...``), raised before vLLM allocates anything or serves.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from vllm_kvpool.bandwidth import DEFAULT_HALF_LIFE, DEFAULT_LEARN_AFTER
from vllm_kvpool.media import COMMON_FIELDS, MediumSettings, media

PlacementPolicy = Literal["bandwidth", "round_robin", "single_tier_serial"]
PLACEMENT_POLICIES: tuple[str, ...] = ("bandwidth", "round_robin", "single_tier_serial")
LOAD_MODES: tuple[str, ...] = ("async", "sync")
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# Every chunk's slot is aligned up to this many bytes (O_DIRECT; layout/chunk.py takes it from
# here: this module cannot import the layout package, which imports torch and this module), so
# a device smaller than it holds no chunk whatever the model.
SLOT_ALIGNMENT = 4096  # covers the logical block size of NVMe/loop devices and O_DIRECT files
# copy_threads' largest value: a fetch's host copy starts up to copy_threads threads (as many as
# it has 4 MiB slices), and the largest servers have fewer cores (2 x 192 cores x 2 SMT = 768
# hardware threads); the probe stops at 8, where memory bandwidth is saturated. A fixed bound,
# not this machine's core count, so that `kvpool validate` answers the same wherever it runs.
COPY_THREADS_LIMIT = 1024


class PoolConfigError(ValueError):
    """A malformed pool config; the message names the field."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"kvpool config: {field_path}: {problem}")
        self.field = field_path
        self.problem = problem


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
    if size >= 2**63:  # the native engine's sizes are 64-bit: a larger one failed only at open
        raise PoolConfigError(field_path, f"{value!r} is more than 2^63 - 1 bytes")
    return size


@dataclass(frozen=True)
class DeviceConfig:
    """One member of the pool, on a registered medium (``media``): a host-memory pool on a NUMA
    node, an SSD (file / block device / SPDK namespace), ..."""

    kind: str  # the medium's name, the entry's key: {host: {...}}
    name: str
    capacity: int  # bytes the pool may use on this device
    numa_node: int = 0  # host: where the pool lives; ssd: where its staging buffers live
    bandwidth_gbps: float | None = None  # fixed placement weight; skips the probe
    settings: MediumSettings = field(default_factory=MediumSettings)  # the medium's own fields


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = True
    seconds: float = 0.5  # per device
    size: int = 64 * 2**20  # bytes moved per probe pass
    # The measured bandwidth (``bandwidth``) replaces the probe's once this many bytes moved
    learn_after: int = DEFAULT_LEARN_AFTER
    half_life: int = DEFAULT_HALF_LIFE  # bytes the pool moves before a measurement weighs half


def default_service_socket() -> str:
    """``$XDG_RUNTIME_DIR/kvpool/pool.sock`` (a per-user 0700 directory), else one under the
    temp directory named by the uid."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvpool" if runtime else Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}"
    return str(base / "pool.sock")


@dataclass(frozen=True)
class ServiceConfig:
    """The per-node pool service (``kvpool daemon``) this engine uses instead of a pool of its
    own: the devices, index and eviction live there, shared by every engine on the node."""

    socket: str = field(default_factory=default_service_socket)
    autostart: bool = True  # start the daemon (with this config's devices) if none answers
    start_timeout: float = 60.0  # seconds to wait for an autostarted daemon's socket


@dataclass(frozen=True)
class MigrationConfig:
    """Background moves of stored chunks off a device whose share time (its stored bytes over
    its measured read bandwidth) exceeds another's by ``margin`` (``migration``)."""

    enabled: bool = False
    margin: float = 0.25  # relative excess of a share time that starts moves
    bandwidth: int = 64 * 2**20  # bytes per second the moves may copy, on average
    every: float = 5.0  # seconds between two plans of moves


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
    # A request whose pooled prefix goes on into a chunk still being saved (an earlier
    # request's, just finished) is held up to this long for that save, then recomputes the
    # rest; 0: never held.
    save_wait_seconds: float = 0.5
    service: ServiceConfig | None = None  # None: the pool lives in this engine (the default)
    migration: MigrationConfig = field(default_factory=MigrationConfig)

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
            body: dict[str, Any] = {"name": d.name, "capacity": d.capacity,
                                    "numa_node": d.numa_node, **d.settings.to_dict()}
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
            "save_wait_seconds": self.save_wait_seconds,
            "migration": vars(self.migration).copy(),
            **({"service": vars(self.service).copy()} if self.service else {}),
        }


def _check_keys(obj: Any, allowed: Collection[str], field_path: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        # the top level ("") is the whole pool config: an empty file, a list, a bare word
        raise PoolConfigError(field_path or "pool", f"expected a mapping, got {type(obj).__name__}")
    for key in obj:
        if key not in allowed:
            raise PoolConfigError(
                f"{field_path}.{key}" if field_path else str(key),
                f"unknown field (allowed: {', '.join(sorted(allowed))})",
            )
    return obj


# Readers of one field of a config mapping; an error names the field (media's settings use them).
def int_field(obj: Mapping[str, Any], key: str, default: int, field_path: str,
              minimum: int = 0, maximum: int | None = None) -> int:  # fmt: skip
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or maximum is not None and value > maximum:  # fmt: skip
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."), f"expected an integer {bounds}, "
                                                     f"got {value!r}")  # fmt: skip
    return value


def bool_field(obj: Mapping[str, Any], key: str, default: bool, field_path: str) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."), f"expected true/false, got {value!r}")
    return value


def float_field(obj: Mapping[str, Any], key: str, default: float | None,
                field_path: str, zero_ok: bool = False) -> float | None:  # fmt: skip
    value = obj.get(key, default)
    if value is None:
        return None
    # YAML's .nan / .inf and JSON's NaN / Infinity parse as floats: none is a usable setting
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero_ok):  # fmt: skip
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."),
                              f"expected a finite {'number >= 0' if zero_ok else 'positive number'}, "
                              f"got {value!r}")  # fmt: skip
    return float(value)


def choice_field(obj: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...],
                 field_path: str) -> str:  # fmt: skip
    value = obj.get(key, default)
    if value not in choices:
        raise PoolConfigError(f"{field_path}.{key}".lstrip("."),
                              f"{value!r} is not one of {', '.join(choices)}")  # fmt: skip
    return value


def _media_list() -> str:
    return ", ".join(media())


def _parse_device(entry: Any, index: int) -> DeviceConfig:
    where = f"devices[{index}]"
    if not isinstance(entry, dict) or len(entry) != 1:
        raise PoolConfigError(where, f"each device is a one-key mapping {{<medium>: {{...}}}} "
                                     f"(media: {_media_list()})")  # fmt: skip
    kind, body = next(iter(entry.items()))
    medium = media().get(kind)
    if medium is None:
        raise PoolConfigError(where, f"unknown medium {kind!r} (media: {_media_list()})")
    where = f"{where}.{kind}"
    body = _check_keys(body, COMMON_FIELDS | medium.settings.keys(), where)
    if "capacity" not in body:
        raise PoolConfigError(f"{where}.capacity", "missing")
    name = body.get("name", "")
    if not isinstance(name, str):
        raise PoolConfigError(f"{where}.name", f"expected a string, got {name!r}")
    capacity = parse_size(body["capacity"], f"{where}.capacity")
    if capacity < SLOT_ALIGNMENT:  # the model's chunk size is checked when the pool opens
        raise PoolConfigError(f"{where}.capacity", f"{capacity} bytes holds no chunk: a chunk's "
                                                   f"slot is at least {SLOT_ALIGNMENT} bytes")  # fmt: skip
    return DeviceConfig(
        kind, name, capacity,
        numa_node=int_field(body, "numa_node", 0, where),
        bandwidth_gbps=float_field(body, "bandwidth_gbps", None, where),
        settings=medium.settings.parse({k: v for k, v in body.items() if k not in COMMON_FIELDS},
                                       where),
    )  # fmt: skip


def _name_devices(devices: list[DeviceConfig]) -> tuple[DeviceConfig, ...]:
    """Default names (medium name + count: host0, ssd1), checked unique, as are the fields a
    medium marks unique (an SSD's file)."""
    counts: Counter[str] = Counter()
    named, seen, claimed = [], set(), set()
    for i, d in enumerate(devices):
        name = d.name or f"{d.kind}{counts[d.kind]}"
        counts[d.kind] += 1
        if name in seen:
            raise PoolConfigError(f"devices[{i}].{d.kind}.name", f"duplicate device name {name!r}")
        seen.add(name)
        for key, value in d.settings.unique_fields().items():
            if (d.kind, key, value) in claimed:
                raise PoolConfigError(f"devices[{i}].{d.kind}.{key}", f"{value} is listed twice")
            claimed.add((d.kind, key, value))
        named.append(replace(d, name=name))
    return tuple(named)


_TOP_KEYS = {"devices", "chunk_tokens", "placement", "probe", "load_mode", "load_failure",
             "verify_checksums", "copy_threads", "save_decode", "staging",
             "device_retry_seconds", "save_wait_seconds", "service", "migration"}  # fmt: skip
_MIGRATION_KEYS = {"enabled", "margin", "bandwidth", "every"}
_SERVICE_KEYS = {"socket", "autostart", "start_timeout"}
_PROBE_KEYS = {"enabled", "seconds", "size", "learn_after", "half_life"}


def parse_pool_config(raw: Any) -> PoolConfig:
    """Validate a plain mapping (the parsed YAML/JSON) into a ``PoolConfig``."""
    raw = _check_keys(raw, _TOP_KEYS, "")
    devices_raw = raw.get("devices")
    if not isinstance(devices_raw, list) or not devices_raw:
        raise PoolConfigError("devices", f"expected a non-empty list of {{<medium>: {{...}}}} "
                                         f"(media: {_media_list()})")  # fmt: skip
    devices = _name_devices([_parse_device(d, i) for i, d in enumerate(devices_raw)])
    probe_raw = _check_keys(raw.get("probe", {}), _PROBE_KEYS, "probe")
    probe = ProbeConfig(
        enabled=bool_field(probe_raw, "enabled", True, "probe"),
        seconds=float_field(probe_raw, "seconds", 0.5, "probe"),
        size=parse_size(probe_raw.get("size", 64 * 2**20), "probe.size"),
        learn_after=parse_size(probe_raw.get("learn_after", DEFAULT_LEARN_AFTER),
                               "probe.learn_after"),
        half_life=parse_size(probe_raw.get("half_life", DEFAULT_HALF_LIFE), "probe.half_life"),
    )
    return PoolConfig(
        devices=devices,
        chunk_tokens=int_field(raw, "chunk_tokens", 256, "", minimum=1),
        placement=choice_field(raw, "placement", "bandwidth", PLACEMENT_POLICIES, ""),
        probe=probe,
        load_mode=choice_field(raw, "load_mode", "async", LOAD_MODES, ""),
        load_failure=choice_field(raw, "load_failure", "recompute", LOAD_FAILURE_POLICIES, ""),
        verify_checksums=bool_field(raw, "verify_checksums", False, ""),
        copy_threads=int_field(raw, "copy_threads", 0, "", minimum=0, maximum=COPY_THREADS_LIMIT),
        save_decode=bool_field(raw, "save_decode", True, ""),
        staging=parse_size(raw.get("staging", 256 * 2**20), "staging"),
        device_retry_seconds=float_field(raw, "device_retry_seconds", 10.0, ""),
        save_wait_seconds=float_field(raw, "save_wait_seconds", 0.5, "", zero_ok=True),
        service=(service := _parse_service(raw.get("service"))),
        migration=_parse_migration(raw.get("migration", {}), service),
    )


def _parse_migration(raw: Any, service: ServiceConfig | None) -> MigrationConfig:
    raw = _check_keys(raw, _MIGRATION_KEYS, "migration")
    enabled = bool_field(raw, "enabled", False, "migration")
    if enabled and service is not None:
        raise PoolConfigError("migration.enabled", "not available with the pool service yet "
                                                   "(an in-process pool only)")  # fmt: skip
    margin = float_field(raw, "margin", 0.25, "migration")
    every = float_field(raw, "every", 5.0, "migration")
    assert margin is not None and every is not None
    if margin < 0 or every <= 0:
        raise PoolConfigError("migration.margin" if margin < 0 else "migration.every",
                              "must be >= 0" if margin < 0 else "must be > 0")  # fmt: skip
    bandwidth = parse_size(raw.get("bandwidth", 64 * 2**20), "migration.bandwidth")
    if bandwidth <= 0:
        raise PoolConfigError("migration.bandwidth", "must be > 0 bytes per second")
    return MigrationConfig(enabled, margin, bandwidth, every)


def check_socket_path(sock: Any, field_path: str) -> str:
    """A Unix socket path that fits ``sockaddr_un`` (107 bytes and the NUL)."""
    if not isinstance(sock, str) or not sock or len(sock.encode()) > 107:
        raise PoolConfigError(field_path, f"expected a Unix socket path of at most 107 bytes, "
                                          f"got {sock!r}")  # fmt: skip
    return sock


def _parse_service(raw: Any) -> ServiceConfig | None:
    """``service: true`` (defaults), a mapping, or absent / false (in-process pool)."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return ServiceConfig()
    raw = _check_keys(raw, _SERVICE_KEYS, "service")
    sock = check_socket_path(raw.get("socket", default_service_socket()), "service.socket")
    timeout = float_field(raw, "start_timeout", 60.0, "service")
    assert timeout is not None
    return ServiceConfig(sock, bool_field(raw, "autostart", True, "service"), timeout)


def _parse_text(text: str, origin: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML's message spans lines (context, a caret under the source): one line of it
        raise PoolConfigError(origin, f"neither valid JSON nor YAML: {' '.join(str(exc).split())}") from None


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
        raise PoolConfigError("pool", f"config file {text} " + ("is not a file" if path.exists()
                                                                 else "does not exist"))
    try:
        body = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PoolConfigError(f"pool ({text})", f"not UTF-8 text: {exc.reason} at byte "
                                                f"{exc.start}") from None
    return parse_pool_config(_parse_text(body, f"pool ({text})"))


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
