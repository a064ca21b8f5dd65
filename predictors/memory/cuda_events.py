"""A real CUDA caching-allocator event stream replayed through :class:`CachingAllocatorSim`.

PyTorch records every allocator event when ``torch.cuda.memory._record_memory_history`` is on;
``torch.cuda.memory._snapshot()`` returns them (``device_traces``: ``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ... with address, size and stream)
with the cached segments and their blocks. :func:`compact` keeps just that (no stack frames);
:func:`replay` seeds the simulator with the segments as they were before the recorded step
(every block allocated in address order as a request of its own, the inactive ones freed
again: blocks of 10 MiB and more get segments of their own as in PyTorch, smaller ones are
packed by the simulator's rules, an approximation of the recorded layout) and feeds it the
step's allocations and completed frees. What it reports is what the simulator's rules make of
the *real* request stream: where it matches ``max_memory_allocated`` / ``max_memory_reserved``,
any error of a prediction lies in the traced stream (which tensors, workspaces, in which
order), not in the allocator rules. The GPU kit records such streams
(``GPUCHECK_MEMORY_EVENTS=1``, docs/gpu-check.md).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .allocator import AllocatorStats, CachingAllocatorSim

# [address, total size, stream, segment type, [[block size, block state, requested], ...]]
Segment = list
# [action, address, size, stream]
Event = list


@dataclass(frozen=True)
class RecordedStep:
    point: dict[str, Any]  # what was measured (the kit's grid point)
    segments_before: list[Segment]
    events: list[Event]


def compact(snapshot: dict) -> tuple[list[Segment], list[Event]]:
    """(segments, events) of a ``torch.cuda.memory._snapshot()`` dict, without stacks."""
    segments = [[s["address"], s["total_size"], s["stream"], s["segment_type"],
                 [[b["size"], b["state"], b.get("requested_size")] for b in s["blocks"]]]
                for s in snapshot["segments"]]
    events = [[e["action"], e["addr"], e["size"], e["stream"]]
              for trace in snapshot.get("device_traces", []) for e in trace]
    return segments, events


def load_steps(path: Path) -> Iterator[RecordedStep]:
    """The kit's ``memory_events.jsonl.gz``: a line naming each point, then its step (or an
    ``error`` line when recording failed there)."""
    point: dict[str, Any] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            rec = json.loads(line)
            if "point" in rec:
                point = rec["point"]
            elif "events" in rec:
                yield RecordedStep(point, rec["segments_before"], rec["events"])


def replay(step: RecordedStep, **allocator: Any) -> AllocatorStats:
    """Peaks of the simulator over the recorded step, from the recorded starting segments;
    ``allocator``: :class:`CachingAllocatorSim` settings (``max_split_size``, ...)."""
    sim = CachingAllocatorSim(**allocator)
    seeded = [(sim.malloc(size), state)
              for seg in sorted(step.segments_before, key=lambda s: s[0])
              for size, state, _ in seg[4]]
    for handle, state in seeded:
        if state != "active_allocated":
            sim.free(handle)
    sim.reset_peak()
    live: dict[int, int] = {}
    for action, addr, size, _ in step.events:
        if action == "alloc":
            live[addr] = sim.malloc(size)
        elif action == "free_completed" and addr in live:
            sim.free(live.pop(addr))
    return sim.stats
