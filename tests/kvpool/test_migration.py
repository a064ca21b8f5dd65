"""Background migration of stored chunks (issue #46 item 2): which chunks move (pure logic),
moves in a real pool while fetches go on (every byte identical, the slowed device emptied to the
margin, old slots freed once unread), and a SIGKILL at random points of a migration between two
SSD files leaving every chunk readable byte for byte after a restart."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_kvpool.migration import pick_moves, share_times

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def test_share_time_is_stored_bytes_over_bandwidth():
    assert share_times([2 * 10**9, 0, 10**9], [1.0, 2.0, 0.0]) == [2.0, 0.0, float("inf")]


def test_moves_go_from_the_longest_share_to_the_shortest_until_within_the_margin():
    # device 1 holds as much as device 0 at a third of its speed: 3x its share time
    moves = pick_moves([12 * MIB, 12 * MIB], [3.0, 1.0], [100, 100], [[MIB] * 12, [MIB] * 12])
    assert moves and all(src == 1 and dst == 0 for src, _, dst in moves)
    assert [i for _, i, _ in moves] == list(range(len(moves)))  # in the given order
    left, got = 12 - len(moves), 12 + len(moves)  # MiB on device 1 (1 GB/s), 0 (3 GB/s)
    # the last move was due (1's share time above 0's new one by the margin), the next is not
    assert left + 1 > 1.25 * got / 3.0
    assert left <= 1.25 * (got + 1) / 3.0
    assert pick_moves([12 * MIB, 4 * MIB], [3.0, 1.0], [100, 100],
                      [[MIB] * 12, [MIB] * 4]) == []  # already proportional: nothing moves


def test_no_move_to_a_full_or_failed_device_nor_beyond_the_limit():
    chunks = [[MIB] * 8, [MIB] * 8, []]
    assert pick_moves([8 * MIB, 8 * MIB, 0], [1.0, 4.0, 0.0], [0, 0, 50], chunks) == []
    assert len(pick_moves([8 * MIB, 0, 0], [1.0, 4.0, 4.0], [0, 50, 50],
                          [[MIB] * 8, [], []], limit=2)) == 2  # fmt: skip


kvio = pytest.importorskip("vllm_kvpool._kvio")

from vllm_kvpool.local import LocalPool  # noqa: E402

BLOCKS, BLOCK = 64, 16  # 16 chunks of 4 blocks, 48 KiB each


def make_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-2**31, 2**31 - 1, (BLOCKS, 2, BLOCK, 96), dtype=torch.int32,
                                   generator=g) for i in range(2)}  # fmt: skip


def config(tmp: Path, host: bool = True) -> dict:
    devices = [{"host": {"capacity": "1MiB"}}] if host else []
    return {"chunk_tokens": 64, "copy_threads": 1, "staging": "256KiB",
            "probe": {"enabled": False, "learn_after": 1, "half_life": "1MiB"},
            "devices": [*devices,
                        {"ssd": {"path": str(tmp / "a.kvpool"), "capacity": "2MiB"}},
                        {"ssd": {"path": str(tmp / "b.kvpool"), "capacity": "2MiB"}}]}


HASHES = [f"mig-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]
IDS = list(range(BLOCKS))


def per_device(pool: LocalPool) -> list[int]:
    counts = [0] * len(pool.config.devices)
    for e in pool.pool.index.entries.values():
        counts[e.location.device] += 1
    return counts


def slow_down(pool: LocalPool, device: int, gbps: float) -> None:
    """The pool's reads of ``device`` measured at ``gbps`` (what a throttled SSD reports), and
    the split they propose kept by the guard (as once a fetch measured it no slower):
    migration balances by the kept split."""
    w = pool.pool.weights
    w.observe(device, "read", 10**8, 10**8 / (gbps * 1e9))
    w.guard.reset(w.estimates())


def test_moves_while_fetching_keep_every_byte_and_free_the_old_slots(tmp_path):
    kv = make_kv(0)
    want = {k: t.clone() for k, t in kv.items()}
    with LocalPool(config(tmp_path), kv, BLOCKS, BLOCK, bandwidths=[4.0, 1.0, 1.0]) as pool:
        assert pool.save(HASHES, IDS) == 16
        before = per_device(pool)
        assert before[2] > 0
        slow_down(pool, 2, 0.1)  # the second SSD now reads at a tenth of the first
        free_before = [a.num_free for a in pool.pool.slots]
        started = pool.migrate(bytes_per_second=2 * MIB)  # ~25 ms a chunk: fetches overlap
        assert started > 0
        fetches = 0
        while pool.pool.moves or fetches < 3:
            for t in kv.values():
                t.zero_()
            r = pool.fetch(HASHES, IDS)
            fetches += 1
            assert r.ok and r.blocks == BLOCKS
            for k in kv:
                assert torch.equal(kv[k], want[k]), (k, fetches)
        pool.wait_moves()
        after = per_device(pool)
        assert after[2] == before[2] - started and sum(after) == 16
        lookups = pool.status().lookups
        assert lookups.moves_done == started and lookups.moves_failed == 0
        # every old slot freed: the chunks occupy exactly one slot each again
        used = [a.total - a.num_free for a in pool.pool.slots]
        assert used == after
        assert sum(free_before) == sum(a.num_free for a in pool.pool.slots)
        # balanced within the margin for the speeds this test states: the fetches above taught
        # the pool their real timings (a loaded machine moves them), so restate the world first
        for device, gbps in enumerate((4.0, 1.0, 0.1)):
            slow_down(pool, device, gbps)
        assert pool.migrate(bytes_per_second=2 * MIB) == 0


def test_moves_follow_the_split_the_guard_keeps_not_an_estimate_it_refused():
    """Migration balances by the guard's kept split (#46): h1's reads measured 4x faster than
    h0's propose more on h1, but until a fetch measured such a split no slower (a token
    bucket's burst reads fast at a small share only) no stored chunk moves onto it; once the
    guard keeps it, chunks move from h0 to h1."""
    from tests.kvpool.test_bandwidth import CHUNK, _in_process
    from vllm_kvpool.protocol import WorkerReport

    plan, apply, _ = _in_process()
    pool = apply.__self__
    hs = [f"m{i}".encode() for i in range(32)]
    placed = plan("r0", [(i, hs[i:i + 2]) for i in range(0, 32, 2)])
    assert placed.count(0) == placed.count(1) == 8
    apply(WorkerReport(observations=[(0, "read", 8 * CHUNK, 8 * CHUNK / 1e9),
                                     (1, "read", 8 * CHUNK, 8 * CHUNK / 4e9)]))  # fmt: skip
    assert pool.weights.gbps[1] == pytest.approx(4 * pool.weights.gbps[0])
    assert pick_moves([8 * CHUNK] * 2, pool.weights.estimates(), [100, 100],
                      [[CHUNK] * 8] * 2)  # by the estimates alone, chunks would move to h1
    assert pool.plan_moves() == []  # the kept split is still the even one
    pool.weights.guard.reset(pool.weights.estimates())  # as once a fetch measured it no slower
    moves = pool.plan_moves()
    assert moves and all(m.device == 0 and m.dest_device == 1 for m in moves)


CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from tests.kvpool.test_migration import HASHES, IDS, BLOCKS, BLOCK, config, make_kv, slow_down
from vllm_kvpool.local import LocalPool
from pathlib import Path
kv = make_kv(0)
pool = LocalPool(config(Path(sys.argv[1]), host=False), kv, BLOCKS, BLOCK,
                 bandwidths=[1.0, 1.0], layout_id="mig")
if sys.argv[2] == "save":
    print(json.dumps({"saved": pool.save(HASHES, IDS)}), flush=True)
else:
    for t in kv.values():
        t.zero_()
    r = pool.fetch(HASHES, IDS)
    print(json.dumps({"blocks": r.blocks, "ok": r.ok, "identical": all(
        torch.equal(kv[k], v) for k, v in make_kv(0).items())}), flush=True)
    # then move back and forth until killed: the slow device flips every round
    for i in range(10**6):
        src = 1 if i % 2 == 0 else 0
        slow_down(pool, src, 0.05)
        slow_down(pool, 1 - src, 5.0)
        pool.migrate(bytes_per_second=8 * 2**20)
        print(json.dumps({"round": i}), flush=True)
        pool.wait_moves()
"""


def _child(tmp: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp), mode, str(REPO)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def test_sigkill_during_migration_leaves_every_chunk_readable(tmp_path):
    """Two SSD files; a process moves every chunk back and forth between them and is killed
    with SIGKILL at random moments; each restart restores the SSDs' records and fetches all 16
    chunks byte for byte (then migrates again until the next kill)."""
    save = _child(tmp_path, "save")
    assert json.loads(save.stdout.readline()) == {"saved": 16}
    save.wait(timeout=60)
    rng = random.Random(46)
    for kill in range(4):
        proc = _child(tmp_path, "check")
        try:
            got = json.loads(proc.stdout.readline())
            assert got == {"blocks": BLOCKS, "ok": True, "identical": True}, kill
            assert json.loads(proc.stdout.readline()) == {"round": 0}
            time.sleep(rng.uniform(0.01, 0.25))  # somewhere inside the moves of round 0 or 1
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    final = _child(tmp_path, "check")
    assert json.loads(final.stdout.readline()) == {"blocks": BLOCKS, "ok": True, "identical": True}
    final.kill()
    final.wait(timeout=30)
