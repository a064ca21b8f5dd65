"""The guard on adaptive placement: a new split is kept only if a fetch showed it is not slower.

Bandwidth placement assumes a device's rate does not depend on its share: fetch time =
max_d(bytes_d / rate_d). Real devices break that (a token bucket, a queue depth, a cache that
holds a burst): a device measured fast at a small share is slow at a larger one, so following
the estimates moves chunks across the knee and back, and the adaptive split lost to plain round
robin (issue #46: S3p 0.92x, S4 before/recovered 0.87x/0.82x). The estimates stay the proposal;
this module decides whether placement may follow them (champion / challenger):

* The **champion** is the split placement uses. The first one is the prior's (the probe's
  figures; an even split, as round robin, when they are equal). Each fetch that read the
  champion's split re-measures it: its time is the fetch's share time as observed (max over
  devices of their busy seconds) per byte fetched, the latest such fetch (a device that slows
  down makes its champion slower at once, so a challenger is compared with it as it is now).
* When the estimates' split differs from the champion's (``MIN_CHANGE``), a step toward it
  becomes the **challenger**: new requests are placed by it until a fetch of its split is
  measured. The step is the whole way at first and halves after each rejection (down to
  ``MIN_STEP``): a device measured fast below its knee is proposed past it, and halving the
  step walks the challengers back toward the knee instead of crossing it again and again. It
  replaces the champion only if that fetch's time per byte is not above the champion's latest;
  else the champion stays and no challenger is tried for ``RETRY_AFTER`` fetches of the
  champion, twice as many after each further rejection (up to ``MAX_WAIT``; a challenger never
  fetched is dropped after ``RETRY_AFTER``). The wait ends early when the champion's own time
  moves by more than ``CHANGED`` from what the rejected challenger was compared with, or one
  device reads its part of the champion's split ``DEVICE_CHANGED`` times faster or slower than
  then (a device that is not the slowest can recover without moving the fetch's time): the
  devices changed, so the old verdict is moot (the step is whole again). A challenger that
  was rejected but came within ``CLOSE`` of the champion is followed at once by the half step
  (no wait): it crossed a knee by little, and the split in between may be the best (S4 after
  the restore: 160 MiB on the recovered SSD 6% slower than the cut 64 MiB, 128 MiB fastest).
* **Splits measured slower are remembered** (a rejected challenger; a champion a challenger
  beat): no challenger goes as far toward one of them as that split itself (the projection of
  its step on the way to it), so a device's knee, once found, is not crossed again each time
  its estimate, measured below the knee, proposes more (``bandwidth``'s restart makes that
  estimate jump back up at each fetch below the knee). The memory is dropped when the
  champion's fetch says the devices changed since (the same rule as the wait's) and each entry
  after ``MAX_WAIT`` champion fetches.

* **Equal evidence on a noisy machine**: a challenger is compared with the faster of the
  champion's latest ``EVIDENCE`` fetches; one slower by less than the **noise band** (the
  largest of the champion's latest fetch-to-fetch moves, at most ``CHANGED``; 0 until measured)
  is fetched once more and its faster fetch decides. On the loaded development machine one
  fetch of a split moved ~15% between neighbouring steps, and one slow fetch had rejected
  round robin's own split (S4 after the restore, development run 3). A change of the
  champion's time counts as the devices changing only beyond twice the band as well.
* **A device that recovers gets its old split back**: when the champion's own fetch says the
  devices changed since its previous fetch (the rule above), the champion from before the
  previous change (the latest one of another split, of ``KEEP_BEFORE``) is the challenger at
  once, with the splits it had measured slower, restored if it wins. A device that slowed and
  recovered is usually back at its old speed, and that split was measured there; the
  estimates, learning the recovered device from fetches of the cut split, proposed past its
  knee first (S4: the recovered phase 0.73-0.92x round robin in development runs).

Why this cannot settle slower than the prior's split: every champion after the first was
measured, when it took over, no slower than the champion it replaced, measured on the same
devices; by induction no slower than the first champion, the prior's split. On devices whose
speed does not change the split placement settles on is therefore no slower than the prior's
(the even split when the priors are equal), whatever shape a device's rate has. What a
rejected challenger costs is bounded and shrinks: on steady devices the waits double, so
after k rejections in a row at most k of the last ``RETRY_AFTER * (2**k - 1) + k`` fetches
were trials (a device whose rate drops above a knee in its share is proposed more than the
knee after each fetch below it: without the doubling one fetch in ``RETRY_AFTER + 1`` would
pay for crossing it). A close rejection costs at most ``CLOSE`` of a fetch and halves the step,
so at most ``log2(1 / MIN_STEP)`` of them come in a row; the memory of slower splits only
removes trials.

A fetch is matched to the champion or the challenger by its split (the bytes each device
served), compared with the split the pool placed by each (``placed``: the chunk counts, caps
included); a fetch of an older prefix placed otherwise (further than ``MATCH`` from both)
teaches the guard nothing, though it still teaches the estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# L1 distance between share vectors below which two splits are the same; small, because devices
# full to their capacity keep their weight (S4: moving one of the SSDs' 8 chunks changed the
# weights' shares by 0.034 beside two full host pools)
MIN_CHANGE = 0.02
MATCH = 0.25  # a fetch's split further than this (L1) from both candidates' is neither's
RETRY_AFTER = 4  # champion fetches after a rejected (or never fetched) challenger
MAX_WAIT = 32  # the longest wait after rejections in a row
CHANGED = 0.25  # the champion's time moved by this fraction: the devices changed, try again
SAME = 1e-9  # L1 distance below which two placed splits are the same
DEVICE_CHANGED = 2.0  # one device's seconds per byte moved by this factor: the devices changed
MIN_STEP = 1 / 8  # the shortest step from the champion toward the estimates' split
CLOSE = 0.1  # a rejected challenger this close to the champion: the half step is tried at once
EVIDENCE = 2  # fetches a close challenger gets (and of the champion's it is compared with)
KEEP_BEFORE = 3  # champions remembered from before device changes (see ``_devices_changed``)
NOISE_SAMPLES = 4  # the champion's latest fetch-to-fetch moves that set the noise band


def shares(values: Sequence[float]) -> list[float]:
    """``values`` as fractions of their sum (all zero when the sum is)."""
    total = sum(values)
    return [v / total if total > 0 else 0.0 for v in values]


def distance(a: Sequence[float], b: Sequence[float]) -> float:
    """L1 distance between two share vectors (0: the same split, 2: disjoint devices)."""
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


@dataclass
class Candidate:
    """A split: the weights placement is given, the split it really placed, its latest time."""

    weights: list[float]
    placed: list[float] | None = None  # shares of the chunks placed by it (caps included)
    seconds_per_byte: float | None = None
    times: list[float] = field(default_factory=list)  # its latest ``EVIDENCE`` fetches' times


class SplitGuard:
    """Champion / challenger over placement splits (see the module's docstring)."""

    def __init__(self, prior: Sequence[float]) -> None:
        self.reset(prior)

    def reset(self, prior: Sequence[float]) -> None:
        """Start over from ``prior`` (a device failed or came back: the old times are moot)."""
        self.champion = Candidate(list(prior))
        self.challenger: Candidate | None = None
        self.wait = 0  # champion fetches before the next challenger may be tried
        self.next_wait = RETRY_AFTER  # the wait after the next rejection
        self.rejected_at: float | None = None  # the champion's time the last rejection saw
        self.devices_at: list[float | None] = []  # and its devices' seconds per byte then
        self.devices: list[float | None] = []  # the champion's latest fetch, per device
        self.step = 1.0  # how far a challenger goes from the champion toward the proposal
        self.unfetched = 0  # champion fetches since the challenger was placed, unmeasured
        # splits measured slower than a champion (shares, champion fetches left to remember
        # them), and the champion's time and devices when the latest of them was recorded
        self.slower: list[tuple[list[float], int]] = []
        self.slower_at: tuple[float, list[float | None]] | None = None
        # how much the champion's time moved from one fetch to the next (the machine's noise:
        # moves above ``CHANGED`` are the devices changing, not noise), the latest few
        self.noise: list[float] = []
        # the champions (weights, splits each had measured slower) when the devices changed,
        # latest last, one per split, and what a returning challenger brings back if it wins
        # (see ``_devices_changed``)
        self.before: list[tuple[list[float], list[tuple[list[float], int]],
                                list[float] | None]] = []  # (weights, slower, placed)
        self.returning: list[tuple[list[float], int]] = []
        # the splits remembered slower as of the champion's latest fetch: one recorded since
        # may have been measured after the devices changed (S4: a challenger fetched in the
        # first slowed step was compared with the champion's time from before the slowdown)
        self.checked: list[tuple[list[float], int]] = []

    def choose(self, proposal: Sequence[float]) -> list[float]:
        """The weights new chunks are placed by, given the estimates' ``proposal``."""
        if self.challenger is None and self.wait == 0 and self.champion.seconds_per_byte:
            now = shares(self.champion.weights)
            to = [c + self.step * (p - c) for c, p in zip(now, shares(proposal), strict=True)]
            if distance(to, now) > MIN_CHANGE and not self._past_slower(now, to):
                self.challenger = Candidate(to)
                self.unfetched = 0
        return list((self.challenger or self.champion).weights)

    def placed(self, counts: Sequence[int]) -> None:
        """The chunks per device of a request placed by the weights ``choose`` gave last."""
        split = shares(counts)
        if sum(split) <= 0:
            return
        c = self.challenger
        if c is not None and self.champion.placed is not None \
                and distance(split, self.champion.placed) < SAME:  # fmt: skip
            # Capacity caps and whole chunks can place the challenger's weights exactly as the
            # champion's: nothing to measure, and a fetch could not tell them apart; it takes
            # over with the champion's time, so the next proposal can be tried.
            self.champion = Candidate(c.weights, split, self.champion.seconds_per_byte,
                                      self.champion.times)
            self.challenger = None
            return
        (c or self.champion).placed = split

    def observe_fetch(self, nbytes: Sequence[int], seconds: Sequence[float]) -> None:
        """One fetch: per device its bytes and busy seconds (0 bytes: not read)."""
        total = sum(nbytes)
        if total <= 0:
            return
        split = shares(nbytes)
        per_byte = max(s for n, s in zip(nbytes, seconds, strict=True) if n > 0) / total
        devices = [s / n if n > 0 else None for n, s in zip(nbytes, seconds, strict=True)]
        near = [(distance(split, c.placed), i, c)
                for i, c in enumerate((self.champion, self.challenger))
                if c is not None and c.placed is not None]  # fmt: skip
        if not near or min(near)[0] > MATCH:
            return
        _, _, which = min(near, key=lambda x: (x[0], x[1]))  # a tie: the champion's
        if which is self.champion:
            last, last_devices = self.champion.seconds_per_byte, self.devices
            self.champion.seconds_per_byte, self.devices = per_byte, devices
            factor = 1 + max(CHANGED, 2 * self.band())
            if last is not None and self._changed(per_byte, last, last_devices, factor,
                                                  per_byte / last):  # fmt: skip
                self._devices_changed(self._moved(per_byte, last, last_devices, factor))
            elif last is not None:
                self.noise = [*self.noise, abs(per_byte / last - 1)][-NOISE_SAMPLES:]
            self.champion.times = [*self.champion.times, per_byte][-EVIDENCE:]
            self.wait = max(self.wait - 1, 0)
            self.slower = [(split, n - 1) for split, n in self.slower if n > 1]
            if self.rejected_at is not None \
                    and self._changed(per_byte, self.rejected_at, self.devices_at):  # fmt: skip
                self.wait, self.next_wait, self.rejected_at, self.step = 0, RETRY_AFTER, None, 1.0
            if self.slower_at is not None and self._changed(per_byte, *self.slower_at):
                self.slower, self.slower_at = [], None
            self.checked = list(self.slower)
            if self.challenger is not None:
                self.unfetched += 1
                if self.unfetched > RETRY_AFTER:  # placed but never fetched: not kept
                    self.challenger, self.wait = None, RETRY_AFTER
            return
        # Equal evidence: the challenger's faster fetch against the champion's faster of its
        # latest ``EVIDENCE``; one slower fetch within the noise band gets a second one (one
        # fetch of a split moved ~15% between neighbouring steps on the loaded machine, and a
        # single slower fetch rejected round robin's own split in S4, development run 3).
        which.times.append(per_byte)
        which.seconds_per_byte = per_byte
        mine = min(which.times)
        best = min(self.champion.times, default=self.champion.seconds_per_byte)
        if best is None or mine <= best:
            if best is not None:
                self._remember_slower(self.champion.weights, per_byte, devices)
            self.champion, self.devices = which, devices
            self.next_wait, self.rejected_at = RETRY_AFTER, None
            self.slower += [(split, MAX_WAIT) for split, _ in self.returning]
        elif len(which.times) < EVIDENCE and mine <= best * (1 + self.band()):
            self.unfetched = 0
            return  # on trial for one more fetch
        elif mine <= best * (1 + CLOSE) and self.step > MIN_STEP:
            self._remember_slower(which.weights, best, self.devices)
            self.step /= 2  # nearly as fast: half the step may be faster; tried at once
        else:
            self._remember_slower(which.weights, best, self.devices)
            self.wait, self.rejected_at, self.devices_at = self.next_wait, best, self.devices
            self.next_wait = min(2 * self.next_wait, MAX_WAIT)
            self.step = max(self.step / 2, MIN_STEP)
        self.challenger, self.returning = None, []

    def _devices_changed(self, moved: list[int] | None) -> None:
        """The champion's fetch says the devices changed since its previous one (the same rule
        as the wait's): its earlier times are moot, and the champion from before the previous
        change is the challenger at once, with the splits it had measured slower (restored if
        it wins). A device that slowed and recovered is usually back at its old speed (S4),
        and the split kept before the slowdown was measured there; the estimates, learning the
        recovered device from fetches of the slowed split, proposed past its knee first (a
        trial fetch 1.4-1.6x round robin's in ``test_s4_*``, 0.73-0.85x in development runs).
        ``moved``: the devices whose part moved (None: the whole fetch's time did). An earlier
        champion that places each of them as the champion does cannot be faster because of
        them, so it is not offered (S4, development run after the restore: the full host
        pools' part moved 1.29x, noise, and the slowed split was tried again at 1.5x round
        robin's fetch); the change still makes the champion's earlier times moot."""
        self.champion.times = []
        now = shares(self.champion.weights)
        others = [b for b in self.before if distance(shares(b[0]), now) > MIN_CHANGE]
        here = self.champion.placed

        def differs(b: tuple) -> bool:  # places a device that moved otherwise than ``here``
            return moved is None or here is None or b[2] is None or any(
                abs(b[2][d] - here[d]) > SAME for d in moved)  # fmt: skip

        offer = [b for b in others if differs(b)]
        if offer:  # the latest one (a false alarm, noise, must not hide it: a list)
            self.challenger, self.returning, self.unfetched = Candidate(offer[-1][0]), \
                offer[-1][1], 0  # fmt: skip
        self.before = [*others, (list(self.champion.weights), self.checked,
                                 here)][-KEEP_BEFORE:]  # fmt: skip

    def _moved(self, per_byte: float, then: float, devices_then: list[float | None],
               factor: float) -> list[int] | None:  # fmt: skip
        """Which devices ``_changed`` saw move between two fetches of the champion (None: the
        whole fetch's time moved, every device counts)."""
        if abs(per_byte / then - 1) > max(CHANGED, 2 * self.band()):
            return None
        common = per_byte / then
        return [d for d, (a, b) in enumerate(zip(self.devices, devices_then, strict=False))
                if a is not None and b is not None
                and max(a / b / common, b * common / a) >= factor]  # fmt: skip

    def band(self) -> float:
        """How much slower than the champion one fetch of a challenger may be and still get a
        second: the largest of the champion's latest fetch-to-fetch moves (its own noise; 0
        before it has any: a quiet machine's verdicts stay single-fetch), at most
        ``CHANGED``."""
        return min(max(self.noise, default=0.0), CHANGED)

    def _remember_slower(self, weights: Sequence[float], best: float,
                         devices: list[float | None]) -> None:  # fmt: skip
        """``weights`` measured slower than the champion (whose time and devices were
        ``best``, ``devices``): no challenger goes that far in its direction for ``MAX_WAIT``
        champion fetches, or until the devices change."""
        self.slower.append((shares(weights), MAX_WAIT))
        self.slower_at = (best, devices)

    def _past_slower(self, now: list[float], to: list[float]) -> bool:
        """Whether the step ``now`` -> ``to`` reaches as far toward a split remembered as slower
        as that split itself (its projection on the way to it): past a device's knee again."""
        for split, _ in self.slower:
            way = [b - a for a, b in zip(now, split, strict=True)]
            length = sum(w * w for w in way)
            if sum(abs(w) for w in way) > MIN_CHANGE and sum(
                    w * (t - a) for w, t, a in zip(way, to, now, strict=True)) >= length:
                return True
        return False

    def _changed(self, per_byte: float, then: float, devices_then: list[float | None],
                 device_factor: float = DEVICE_CHANGED, common: float = 1.0) -> bool:  # fmt: skip
        """Whether the champion's latest fetch (``per_byte``, ``self.devices``) says the
        devices changed since its time was ``then`` and its devices ``devices_then``: its time
        moved by more than ``CHANGED`` and twice the noise band (a loaded machine's fetches
        move by up to ~40% between neighbouring steps), or one device's by ``device_factor``.
        Between two fetches of the same champion (``_devices_changed``: a false alarm costs
        one fetch of an earlier champion) that is ``1 + max(CHANGED, 2 * band)``, not 2x: a
        fetch that waits on the CPU compresses a device's 3x change to 1.5-1.85x (S4's
        restore, development runs); there each device's move is taken over ``common``, the
        whole fetch's (the loaded machine slows every device of a fetch alike; the slowest
        device's own change moves the fetch's time, the first test)."""
        if abs(per_byte / then - 1) > max(CHANGED, 2 * self.band()):
            return True
        return any(a is not None and b is not None
                   and max(a / b / common, b * common / a) >= device_factor
                   for a, b in zip(self.devices, devices_then, strict=False))  # fmt: skip
