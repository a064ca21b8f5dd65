"""The cluster network as it is: nodes of GPUs on NVLink/NVSwitch, NICs to an InfiniBand fabric.

One model of collective and point-to-point cost for the whole code base (the time predictor's
roofline composes it; nothing else prices communication).

* **Placement.** Megatron orders ranks TP (innermost), then DP, then PP, so a TP group is
  ``tp`` consecutive ranks, a DP group strides by ``tp`` and a PP group by ``tp * dp``. From the
  stride and the node size follow the ranks of one group on one node (``per_node``) and the
  nodes it spans.
* **NICs are shared.** Every rank of a node runs the same kind of collective at the same time
  (all TP groups all-reduce together, all DP groups too), so one rank's share of the node's
  InfiniBand bandwidth is ``nics * nic_bw / gpus_per_node``, and a group's share on a node is
  ``per_node`` times that.
* **All-reduce = NCCL ring or tree, whichever is faster** (NCCL's tuner picks by size). Ring:
  ``2(n-1)/n * bytes`` per rank at the ring's bottleneck, ``min(NVLink, group's NIC share on a
  node)`` when the group spans nodes (the ring crosses each node boundary once per channel,
  channels spread over the NICs), ``2(n-1)`` latency steps. Tree (hierarchical: intra-node
  chain, inter-node double binary tree): the same bottleneck at ``TREE_BW_FACTOR`` of ring's
  rate, ``2(log2(nodes) + per_node-1)`` latency steps: it wins for small messages across many
  nodes.
* **Point-to-point** (pipeline activations): NVLink when the next stage is on the same node,
  else the rank's NIC share.
* **Overlap.** Megatron's ``--overlap-grad-reduce`` launches each gradient bucket's all-reduce
  as soon as backward of the last micro-batch has produced it; only what runs past the end of
  backward is exposed (:func:`exposed_bucketed`). ``--tp-comm-overlap`` hides TP collectives
  under the GEMMs of the same layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fraction of link rate NCCL reaches on large messages (bus bandwidth / link rate on DGX
# A100/H100 nccl-tests); the learned model corrects the rest.
LINK_EFFICIENCY = 0.8
INTER_NODE_HOP_LATENCY = 5e-6  # seconds added per inter-node step (NIC + switch)
# NCCL's own latency model (src/graph/tuning.cc: a ring collective costs baseLat + steps x
# hwLat): over NVLink with the Simple protocol (the one large collectives run) 8.4 us per
# collective and 3.4 us per ring step. A TP all-reduce of 8 ranks on one node takes 14 steps:
# 56 us, where the device's fitted per-step latency (comm_latency, tens of us: what steps
# across nodes cost) made it 280 us, a TP-8 layer's four all-reduces over 1 ms
NVLINK_STEP_LATENCY = 3.4e-6
COLLECTIVE_BASE_LATENCY = 8.4e-6
# NCCL's tuner prices tree bandwidth below ring's (the intra-node chain and the reduction at
# every tree level): large messages go ring, small ones across many nodes go tree.
TREE_BW_FACTOR = 0.85


@dataclass(frozen=True)
class Topology:
    """One node type of a homogeneous cluster. Bandwidths are bytes/s per direction."""

    gpus_per_node: int = 8
    nics_per_node: int = 8
    intra_bw: float = 300e9  # per GPU into NVLink/NVSwitch
    nic_bw: float = 25e9  # per NIC (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s)
    intra_latency: float = NVLINK_STEP_LATENCY  # per collective step, inside a node
    inter_latency: float = 20e-6 + INTER_NODE_HOP_LATENCY
    base_latency: float = COLLECTIVE_BASE_LATENCY  # per collective or send, once

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("intra_bw", "nic_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")

    @property
    def nic_share(self) -> float:
        """Inter-node bytes/s of one rank while every rank of its node communicates."""
        return self.nics_per_node * self.nic_bw / self.gpus_per_node


@dataclass(frozen=True)
class Placement:
    """Where one communication group's ranks sit."""

    size: int
    per_node: int  # ranks of this group on one node
    nodes: int  # nodes the group spans

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


def place(size: int, stride: int, gpus_per_node: int) -> Placement:
    """Group of ``size`` ranks ``r0, r0 + stride, ...`` on nodes of ``gpus_per_node`` ranks."""
    if size <= 1:
        return Placement(max(size, 1), 1, 1)
    per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
    return Placement(size, per_node, math.ceil(size / per_node))


SINGLE = Placement(1, 1, 1)


@dataclass(frozen=True)
class Groups:
    tp: Placement
    dp: Placement
    pp: Placement
    nodes: int
    cp: Placement = SINGLE
    # gradients (and ZeRO/FSDP shards) span DP x CP: the CP ranks of a replica hold the same
    # parameters
    grad: Placement | None = None

    @property
    def grad_group(self) -> Placement:
        return self.grad or self.dp


def megatron_groups(dp: int, tp: int, pp: int, topo: Topology, cp: int = 1) -> Groups:
    """Megatron's rank order TP (innermost), CP, DP, PP."""
    g = topo.gpus_per_node
    return Groups(place(tp, 1, g), place(dp, tp * cp, g), place(pp, tp * cp * dp, g),
                  math.ceil(dp * tp * pp * cp / g), place(cp, tp, g),
                  place(dp * cp, tp, g))  # fmt: skip


@dataclass(frozen=True)
class CommCost:
    seconds: float
    intra_bytes: float = 0.0  # bytes one rank sends over NVLink
    inter_bytes: float = 0.0  # bytes one rank sends over its NIC share
    algorithm: str = "none"

    def __add__(self, other: CommCost) -> CommCost:
        algo = self.algorithm if other.algorithm == "none" else other.algorithm
        return CommCost(self.seconds + other.seconds, self.intra_bytes + other.intra_bytes,
                        self.inter_bytes + other.inter_bytes, algo)  # fmt: skip

    def times(self, n: float) -> CommCost:
        return CommCost(self.seconds * n, self.intra_bytes * n, self.inter_bytes * n,
                        self.algorithm)  # fmt: skip


NO_COMM = CommCost(0.0)


def all_reduce(nbytes: float, group: Placement, topo: Topology) -> CommCost:
    """One all-reduce of ``nbytes`` per rank over ``group``: NCCL ring or tree, the faster."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return NO_COMM
    moved = 2 * (n - 1) / n * nbytes  # per rank, ring and tree alike (bus bytes)
    intra_bw = topo.intra_bw * LINK_EFFICIENCY
    if not group.spans_nodes:
        return CommCost(moved / intra_bw + topo.base_latency + 2 * (n - 1) * topo.intra_latency,
                        moved, 0.0, "ring")
    g, k = group.per_node, group.nodes
    inter_bw = g * topo.nic_share * LINK_EFFICIENCY  # the group's NIC bandwidth on one node
    busy = moved / min(intra_bw, inter_bw)
    # per rank: the inter-node edge of a node carries the ring's traffic once, split over the
    # group's ranks on that node
    inter = 2 * (k - 1) / k * nbytes / g
    intra = moved - inter
    ring = busy + topo.base_latency + 2 * (n - 1) * topo.inter_latency
    tree = busy / TREE_BW_FACTOR + topo.base_latency + 2 * (
        math.ceil(math.log2(k)) * topo.inter_latency + (g - 1) * topo.intra_latency)
    if tree < ring:
        return CommCost(tree, intra, inter, "tree")
    return CommCost(ring, intra, inter, "ring")


def p2p(nbytes: float, inter_node: bool, topo: Topology) -> CommCost:
    """One send (and the matching receive) of ``nbytes`` between neighbouring ranks."""
    if nbytes <= 0:
        return NO_COMM
    if inter_node:
        return CommCost(nbytes / (topo.nic_share * LINK_EFFICIENCY) + topo.inter_latency,
                        0.0, nbytes, "p2p")  # fmt: skip
    return CommCost(nbytes / (topo.intra_bw * LINK_EFFICIENCY) + topo.base_latency
                    + topo.intra_latency, nbytes, 0.0, "p2p")  # fmt: skip


def topology_of(device) -> Topology:
    """The node a :class:`~predictors.devices.Device` sits in (its table's NVLink and per-NIC
    InfiniBand rates, one NIC per GPU as on DGX/HGX nodes). Steps across nodes cost the
    device's ``comm_latency`` (fitted); a GPU's steps inside the node NCCL's NVLink figures,
    a CPU's (shared memory, no NCCL) its ``comm_latency`` with no base."""
    per_node = max(1, int(device.devices_per_node))
    inter = device.comm_latency + INTER_NODE_HOP_LATENCY
    if device.kind != "gpu":
        return Topology(per_node, per_node, device.intra_bw, device.inter_bw,
                        device.comm_latency, inter, 0.0)  # fmt: skip
    return Topology(per_node, per_node, device.intra_bw, device.inter_bw,
                    NVLINK_STEP_LATENCY, inter)  # fmt: skip


def exposed_bucketed(bucket_seconds: list[float], backward_seconds: float) -> float:
    """Time the bucketed gradient all-reduce runs past the end of backward when each bucket
    starts as soon as backward has produced it (buckets fill at a uniform rate) and buckets go
    one at a time on the communication stream."""
    if not bucket_seconds:
        return 0.0
    n = len(bucket_seconds)
    done = 0.0
    for i, t in enumerate(bucket_seconds):
        ready = backward_seconds * (i + 1) / n
        done = max(done, ready) + t
    return max(0.0, done - backward_seconds)
