"""Process groups for one (DP, TP, PP) layout, owned explicitly so two layouts can coexist.

A switch needs the old layout (source, and the rollback target) and the new one alive at the same
time, so CONA never uses megatron's global ``parallel_state`` singletons: every megatron-core
component is handed a :class:`ProcessGroupCollection` built here.  Rank order follows megatron's
default ``tp-cp-ep-dp-pp``::

    global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

Every ``dist.new_group`` call is made by all ranks in the same order (group names come from the
global group counter, so a destroyed group's store keys are never reused), and
:meth:`ParallelGroups.destroy` destroys exactly the groups this object created: after a switch
``len(live_group_count())`` is what it was before.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from predictors.spec import ParallelStrategy


@dataclass(frozen=True)
class RankCoord:
    """Where a global rank sits in a layout."""

    dp: int
    tp: int
    pp: int


def rank_of(strategy: ParallelStrategy, dp: int, tp: int, pp: int) -> int:
    return tp + strategy.tp * (dp + strategy.dp * pp)


def coord_of(strategy: ParallelStrategy, rank: int) -> RankCoord:
    tp = rank % strategy.tp
    dp = (rank // strategy.tp) % strategy.dp
    pp = rank // (strategy.tp * strategy.dp)
    return RankCoord(dp=dp, tp=tp, pp=pp)


def _enumerate_groups(strategy: ParallelStrategy) -> dict[str, list[list[int]]]:
    """All rank lists of every group kind of the layout, in a deterministic order."""
    s = strategy
    r = rank_of
    grid = list(itertools.product(range(s.dp), range(s.tp), range(s.pp)))
    tp = [[r(s, d, t, p) for t in range(s.tp)] for p in range(s.pp) for d in range(s.dp)]
    dp = [[r(s, d, t, p) for d in range(s.dp)] for p in range(s.pp) for t in range(s.tp)]
    pp = [[r(s, d, t, p) for p in range(s.pp)] for d in range(s.dp) for t in range(s.tp)]
    mp = [
        [r(s, d, t, p) for p in range(s.pp) for t in range(s.tp)] for d in range(s.dp)
    ]
    embd = [sorted({g[0], g[-1]}) for g in pp]
    pos_embd = [[g[0]] for g in pp]
    single = [[r(s, d, t, p)] for d, t, p in grid]
    return {"tp": tp, "dp": dp, "pp": pp, "mp": mp, "embd": embd, "pos_embd": pos_embd,
            "single": sorted(single)}


@dataclass
class ParallelGroups:
    """The process groups of one strategy on this rank, plus the megatron collection of them."""

    strategy: ParallelStrategy
    rank: int
    coord: RankCoord
    pg: ProcessGroupCollection
    ranks: dict[str, list[int]]  # group kind -> ranks of this rank's group of that kind
    _owned: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.strategy.pp - 1

    def destroy(self) -> None:
        """Destroy every group this object created (idempotent)."""
        while self._owned:
            group = self._owned.pop()
            dist.destroy_process_group(group)


def build_groups(strategy: ParallelStrategy, backend: str | None = None) -> ParallelGroups:
    """Create the groups of ``strategy`` on the initialized default world (collective call)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before build_groups()")
    world, rank = dist.get_world_size(), dist.get_rank()
    strategy.check(world)
    owned: list[dist.ProcessGroup] = []
    mine: dict[str, dist.ProcessGroup] = {}
    my_ranks: dict[str, list[int]] = {}
    try:
        for kind, groups in _enumerate_groups(strategy).items():
            for ranks in groups:
                group = dist.new_group(ranks, backend=backend)
                owned.append(group)
                if rank in ranks:
                    mine[kind], my_ranks[kind] = group, ranks
    except Exception:
        for group in owned:
            dist.destroy_process_group(group)
        raise
    pg = ProcessGroupCollection()
    pg.tp = pg.tp_cp = pg.expt_tp = pg.tp_ep = mine["tp"]
    pg.pp = mine["pp"]
    pg.mp = pg.tp_ep_pp = mine["mp"]
    # Stages outside the (position) embedding group get None, as in megatron's parallel_state.
    pg.embd = mine.get("embd")
    pg.pos_embd = mine.get("pos_embd")
    my_ranks.setdefault("embd", [])
    my_ranks.setdefault("pos_embd", [])
    pg.cp = pg.ep = mine["single"]
    pg.hcp = [mine["single"]]
    pg.dp = pg.dp_cp = pg.expt_dp = pg.intra_dp_cp = pg.intra_expt_dp = mine["dp"]
    pg.tp_dp_cp = dist.group.WORLD if strategy.pp == 1 else _tp_dp_group(strategy, rank, owned,
                                                                            backend)
    pg.intra_dist_opt = dist.group.WORLD
    pg.inter_dist_opt = None
    return ParallelGroups(strategy, rank, coord_of(strategy, rank), pg, my_ranks, owned)


def _tp_dp_group(strategy: ParallelStrategy, rank: int, owned: list, backend: str | None):
    """tp x dp group of each pipeline stage (used by megatron for some all-reduces)."""
    mine = None
    span = strategy.tp * strategy.dp
    for p in range(strategy.pp):
        ranks = list(range(p * span, (p + 1) * span))
        group = dist.new_group(ranks, backend=backend)
        owned.append(group)
        if rank in ranks:
            mine = group
    return mine


def live_group_count() -> int:
    """Number of process groups torch.distributed currently knows (leak checks)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)



# megatron-core globals some code paths still read instead of taking a group argument
# (e.g. vocab_parallel_cross_entropy reads the TP group).  They are pointed at the layout that
# is running for the duration of a step and restored afterwards.
_GLOBAL_GROUP_NAMES = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_CONTEXT_PARALLEL_GROUP": "cp",
}
_GLOBAL_RANK_NAMES = {
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
}


@contextlib.contextmanager
def megatron_globals(groups: ParallelGroups):
    """Point megatron's ``parallel_state`` globals at ``groups`` inside the block."""
    from megatron.core import parallel_state as ps

    saved = {}
    values = {name: getattr(groups.pg, kind) for name, kind in _GLOBAL_GROUP_NAMES.items()}
    values.update({name: groups.ranks[kind] for name, kind in _GLOBAL_RANK_NAMES.items()})
    for name, value in values.items():
        if hasattr(ps, name):
            saved[name] = getattr(ps, name)
            setattr(ps, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ps, name, value)
