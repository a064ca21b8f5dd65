"""The network model: placement on nodes, NCCL ring/tree, NIC sharing, overlap (deterministic)."""

import pytest

from predictors.devices import get_device
from predictors.spec import ParallelStrategy, StrategyError, TrainingOptions, TransformerSpec
from predictors.time.network import (
    COLLECTIVE_BASE_LATENCY,
    LINK_EFFICIENCY,
    NVLINK_STEP_LATENCY,
    Topology,
    all_reduce,
    exposed_bucketed,
    megatron_groups,
    p2p,
    place,
    topology_of,
)

DGX_A100 = Topology(8, 8, 300e9, 25e9)


def test_megatron_placement():
    g = megatron_groups(dp=4, tp=16, pp=2, topo=DGX_A100)
    assert (g.tp.per_node, g.tp.nodes) == (8, 2)  # TP=16 spans two nodes
    assert (g.dp.per_node, g.dp.nodes) == (1, 4)  # DP strides by tp: one rank per node
    assert g.nodes == 16 and g.pp.nodes == 2
    g = megatron_groups(dp=2, tp=4, pp=1, topo=DGX_A100)
    assert not g.tp.spans_nodes and not g.dp.spans_nodes and g.dp.per_node == 2
    assert place(1, 1, 8).nodes == 1


def test_tp_spanning_nodes_uses_the_nodes_nics_not_one_flat_link():
    """A 16-rank group over 2 nodes all-reduces through all 8 NICs of each node: the ring's
    inter-node edge carries 8 x 25 GB/s, not the 25 GB/s of one GPU's NIC."""
    nbytes = 64e6
    spanning = all_reduce(nbytes, place(16, 1, 8), DGX_A100)
    flat_per_gpu = 2 * 15 / 16 * nbytes / (25e9 * LINK_EFFICIENCY)
    assert spanning.seconds < flat_per_gpu / 4
    one_node = all_reduce(nbytes, place(8, 1, 8), DGX_A100)
    assert one_node.inter_bytes == 0 and spanning.inter_bytes > 0
    assert one_node.seconds < spanning.seconds
    # DP with one rank per node gets only that rank's NIC share
    dp = all_reduce(nbytes, place(16, 8, 8), DGX_A100)
    assert dp.seconds > 4 * spanning.seconds


def test_tree_wins_small_messages_on_many_nodes_ring_large():
    group = place(512, 8, 8)  # one rank per node on 512 nodes
    assert all_reduce(1e3, group, DGX_A100).algorithm == "tree"
    assert all_reduce(1e9, place(4, 8, 8), DGX_A100).algorithm == "ring"
    small = all_reduce(1e3, group, DGX_A100).seconds
    assert small < 2 * 511 * DGX_A100.inter_latency / 10  # log2(512) steps, not 2(n-1)


def test_p2p_and_nic_sharing():
    inter, intra = p2p(1e8, True, DGX_A100), p2p(1e8, False, DGX_A100)
    assert inter.seconds > 5 * intra.seconds and inter.inter_bytes == 1e8
    fewer_nics = Topology(8, 2, 300e9, 25e9)  # 2 NICs for 8 GPUs: each rank gets a quarter
    assert p2p(1e8, True, fewer_nics).seconds > 3.5 * inter.seconds
    with pytest.raises(ValueError, match="nics_per_node"):
        Topology(8, 0)


def test_bucketed_overlap():
    assert exposed_bucketed([1.0] * 4, 100.0) == pytest.approx(1.0)  # only the last bucket
    assert exposed_bucketed([1.0] * 4, 0.0) == pytest.approx(4.0)  # nothing to hide under
    assert exposed_bucketed([], 5.0) == 0.0


def test_options_change_the_prediction_where_they_should():
    from predictors.time.predictor import predict

    gpt = TransformerSpec("gpt", 24, 2048, 16, 2048, 50257)
    s = ParallelStrategy(32, 2, 2, 1, 256)  # 128 GPUs, 16 nodes
    base = predict(gpt, s, "bf16-mixed", "a100-80gb").breakdown
    over = predict(gpt, s, "bf16-mixed", "a100-80gb",
                   options=TrainingOptions(overlap_grad_reduce=True)).breakdown  # fmt: skip
    assert (base.nodes, base.dp_nodes, base.pp_nodes) == (16, 8, 2) and base.inter_bytes > 0
    assert over.dp_comm < base.dp_comm and over.dp_comm_raw == pytest.approx(base.dp_comm_raw)
    vp = predict(gpt, s, "bf16-mixed", "a100-80gb",
                 options=TrainingOptions(virtual_pipeline=2)).breakdown  # fmt: skip
    assert vp.bubble < base.bubble
    with pytest.raises(StrategyError, match="virtual_pipeline=5"):
        predict(gpt, s, "bf16-mixed", "a100-80gb", options=TrainingOptions(virtual_pipeline=5))
    with pytest.raises(StrategyError, match="overlap_param_gather"):
        TrainingOptions(overlap_param_gather=True)


def test_a_collective_inside_a_node_costs_nccls_nvlink_latency_not_the_fitted_step():
    """NCCL prices a ring collective at a base latency plus one hardware latency per step
    (tuning.cc); over NVLink that is 8.4 + 14 x 3.4 us for 8 ranks. The device's fitted
    per-step latency prices the steps across nodes only."""
    from dataclasses import replace

    h100 = get_device("h100-80gb")
    slow = replace(h100, comm_latency=50e-6)
    tiny = 8.0  # bytes: latency-bound
    for dev in (h100, slow):
        topo = topology_of(dev)
        one_node = all_reduce(tiny, place(8, 1, 8), topo).seconds
        assert one_node == pytest.approx(COLLECTIVE_BASE_LATENCY + 14 * NVLINK_STEP_LATENCY,
                                         rel=1e-3)
    spanning = [all_reduce(tiny, place(16, 1, 8), topology_of(d)).seconds for d in (h100, slow)]
    assert spanning[1] > spanning[0]  # across nodes the fitted latency still counts
    cpu = topology_of(get_device("cpu"))  # no NCCL: the device's own latency, no base
    assert cpu.base_latency == 0 and cpu.intra_latency == get_device("cpu").comm_latency
