"""Pool values on the wire: the chunk layout an engine attaches with, index entries, worker
reports. Decoding checks every field (``wire.WireError`` names the bad one): the service decodes
what engines send, engines decode what the service answers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvpool.bandwidth import OPS, check_observation
from vllm_kvpool.index import ChunkEntry, ChunkHit, ChunkLocation
from vllm_kvpool.layout import ChunkLayout, GroupLayout
from vllm_kvpool.metrics import TransferCounters
from vllm_kvpool.protocol import WorkerReport
from vllm_kvpool.service.wire import WireError, field, hash_of, hashes, hexes, int_list


def layout_to_wire(layout: ChunkLayout) -> dict[str, Any]:
    return {"groups": [[g.group_id, list(g.layer_names), g.page_bytes, g.block_size,
                        g.window_blocks, g.sliding_window] for g in layout.groups],
            "blocks_per_chunk": layout.blocks_per_chunk,
            "layout_version": layout.layout_version, "replicated": layout.replicated}  # fmt: skip


def layout_from_wire(msg: Mapping[str, Any]) -> ChunkLayout:
    groups = []
    for i, g in enumerate(field(msg, "groups", list)):
        where = f"layout.groups[{i}]"
        if not (isinstance(g, list) and len(g) == 6 and isinstance(g[1], list)
                and all(isinstance(n, str) for n in g[1])
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in (g[0], g[2], g[3], g[5]))
                and (g[4] is None or isinstance(g[4], int) and g[4] > 0)):  # fmt: skip
            raise WireError(f"field {where!r}: expected [group_id, layer_names, page_bytes, "
                            "block_size, window_blocks, sliding_window]")  # fmt: skip
        if g[2] < 1 or g[3] < 1:
            raise WireError(f"field {where!r}: page_bytes and block_size must be positive")
        groups.append(GroupLayout(g[0], tuple(g[1]), g[2], g[3], g[4], g[5]))
    bpc = field(msg, "blocks_per_chunk", int)
    try:
        return ChunkLayout(tuple(groups), bpc, field(msg, "layout_version", int),
                           field(msg, "replicated", bool))  # fmt: skip
    except ValueError as exc:
        raise WireError(f"field 'layout': {exc}") from None


def entry_to_wire(e: ChunkEntry) -> dict[str, Any]:
    loc = e.location
    return {"key": e.key.hex(), "hashes": hexes(e.block_hashes),
            "loc": [loc.device, loc.slot, loc.num_blocks, loc.nbytes, loc.layout_version],
            "sums": [[r, c] for r, c in e.checksums.items()],
            "validated": e.validated, "restored": e.restored}  # fmt: skip


def entry_from_wire(msg: Mapping[str, Any]) -> ChunkEntry:
    """A committed entry as the service sent it (the engine's copy: pins go by key)."""
    loc = int_list(msg, "loc")
    if len(loc) != 5:
        raise WireError("field 'loc': expected [device, slot, num_blocks, nbytes, layout]")
    entry = ChunkEntry(hash_of(field(msg, "key", str), "key"), tuple(hashes(msg, "hashes")),
                       ChunkLocation(*loc), committed=True)  # fmt: skip
    entry.checksums = {int(r): int(c) for r, c in field(msg, "sums", list)}
    entry.validated = field(msg, "validated", bool)
    entry.restored = field(msg, "restored", bool)
    return entry


def hits_to_wire(hits: list[ChunkHit]) -> list[dict[str, Any]]:
    return [{"entry": entry_to_wire(h.entry), "first": h.first_block, "n": h.num_blocks}
            for h in hits]  # fmt: skip


def hits_from_wire(values: list[Any]) -> list[ChunkHit]:
    return [ChunkHit(entry_from_wire(field(v, "entry", dict)), field(v, "first", int),
                     field(v, "n", int)) for v in values]  # fmt: skip


def report_to_wire(r: WorkerReport) -> dict[str, Any]:
    return {"committed": [[k.hex(), rank, c] for k, rank, c in r.committed],
            "failed_saves": hexes(r.failed_saves), "corrupt": hexes(r.corrupt),
            "failed_devices": [[d, why] for d, why in r.failed_devices.items()],
            "recovered_devices": list(r.recovered_devices),
            "observations": [list(o) for o in r.observations],
            "counters": r.counters.to_dict()}  # fmt: skip


def report_from_wire(msg: Mapping[str, Any], num_devices: int, world_size: int) -> WorkerReport:
    """A worker report as the service takes it: device indices and ranks checked in range."""

    def device(d: Any, where: str) -> int:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < num_devices:
            raise WireError(f"field {where!r}: {d!r} is not a device of this pool")
        return d

    committed = []
    for i, row in enumerate(field(msg, "committed", list)):
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[1], int)
                and 0 <= row[1] < world_size and isinstance(row[2], int)
                and 0 <= row[2] < 2**64):  # fmt: skip
            raise WireError(f"field 'committed[{i}]': expected [key, rank < {world_size}, "
                            "checksum]")  # fmt: skip
        committed.append((hash_of(row[0], f"committed[{i}]"), row[1], row[2]))
    failed_devices = {}
    for i, row in enumerate(field(msg, "failed_devices", list)):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], str)):
            raise WireError(f"field 'failed_devices[{i}]': expected [device, reason]")
        failed_devices[device(row[0], f"failed_devices[{i}]")] = row[1]
    observations = []
    for i, row in enumerate(field(msg, "observations", list)):
        where = f"observations[{i}]"
        if not (isinstance(row, list) and len(row) == 4):
            raise WireError(f"field {where!r}: expected [device, op, bytes, seconds]")
        if row[1] not in OPS:
            raise WireError(f"field '{where}.op': {row[1]!r} is not one of {', '.join(OPS)}")
        if (bad := check_observation(row[2], row[3])) is not None:
            raise WireError(f"field '{where}.{bad[0]}': {bad[1]}")
        observations.append((device(row[0], where), row[1], row[2], float(row[3])))
    raw = field(msg, "counters", dict)
    devices, seconds = raw.get("devices", {}), raw.get("fetch_seconds", [])
    numbers = (int, float)
    if not (isinstance(devices, dict) and isinstance(seconds, list)
            and all(isinstance(v, dict) and all(isinstance(x, numbers) and not isinstance(x, bool)
                                                for x in v.values()) for v in devices.values())
            and all(isinstance(x, numbers) for x in seconds)):  # fmt: skip
        raise WireError("field 'counters': expected {devices: {name: {counter: number}}, "
                        "fetch_seconds: [number]}")  # fmt: skip
    try:
        counters = TransferCounters.from_dict(raw)
    except TypeError as exc:
        raise WireError(f"field 'counters': {exc}") from None
    return WorkerReport(
        committed=committed, failed_saves=hashes(msg, "failed_saves"),
        corrupt=hashes(msg, "corrupt"), failed_devices=failed_devices,
        recovered_devices=[device(d, "recovered_devices") for d in
                           field(msg, "recovered_devices", list)],
        observations=observations, counters=counters)  # fmt: skip
