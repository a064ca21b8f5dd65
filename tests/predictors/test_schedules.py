"""The schedules as Megatron / torchtitan run them: interleaved 1F1B, context parallelism,
full / selective recomputation, torch.compile's fused elementwise kernels."""

from dataclasses import replace

import pytest

from predictors.devices import get_device
from predictors.spec import ParallelStrategy, StrategyError, TrainingOptions, TransformerSpec
from predictors.spec.precision import get_precision
from predictors.time.analytical import StepWork, iteration_time, priced
from predictors.time.features import step_work
from predictors.time.trace import OpRecord, Trace

H100 = get_device("h100-80gb")
LLAMA = TransformerSpec("llama", 4, 256, 4, 256, 1024, num_query_groups=2, swiglu=True,
                        tied_embeddings=False)  # fmt: skip


def _record(phase: str, op_class: str, flops: float) -> OpRecord:
    return OpRecord("k", phase, op_class, "bfloat16", "bf16", (), (), flops, 1e6, True)


def _toy_work() -> StepWork:
    fwd = [_record("forward", "matmul", 4e12), _record("forward", "attention", 1e12),
           _record("forward", "elementwise", 0.0)]  # fmt: skip
    bwd = [_record("backward", "matmul", 8e12), _record("backward", "attention", 2e12)]
    return StepWork(Trace(fwd * 3 + bwd * 3), Trace(), pp_bytes=8e6)


@pytest.mark.parametrize("vp", [1, 2, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m_and_p2p_grows_with_v(vp):
    s = ParallelStrategy(1, 1, 4, 1, 8)  # m = 8 micro-batches on 4 stages
    blocking = TrainingOptions(virtual_pipeline=vp, overlap_p2p_comm=False)
    b = iteration_time(_toy_work(), s, H100, blocking)
    one = iteration_time(_toy_work(), s, H100, TrainingOptions())
    m, p = s.num_microbatches, s.pp
    slot = b.compute_mb + b.tp_comm_mb + b.pp_p2p_mb
    assert b.bubble / (m * slot) == pytest.approx((p - 1) / (vp * m))
    # every model chunk boundary is a send, forward and backward: 2 v sends per micro-batch
    assert b.pp_p2p_mb == pytest.approx(vp * one.pp_p2p_mb)


def test_interleaved_sends_overlap_the_chunks_compute_as_megatron_runs_them():
    """Megatron's default overlap_p2p_comm: with interleaving only sends longer than the
    micro-batch's compute are exposed; without interleaving they block whatever the flag."""
    s = ParallelStrategy(1, 1, 4, 1, 8)
    heavy = replace(_toy_work(), pp_bytes=8e10)  # sends far longer than the toy compute
    for work in (_toy_work(), heavy):
        raw = iteration_time(work, s, H100, TrainingOptions(virtual_pipeline=2,
                                                            overlap_p2p_comm=False))  # fmt: skip
        hidden = iteration_time(work, s, H100, TrainingOptions(virtual_pipeline=2))
        assert hidden.pp_p2p_mb == pytest.approx(max(0.0, raw.pp_p2p_mb - raw.compute_mb))
        assert hidden.total < raw.total
    plain = [iteration_time(heavy, s, H100, TrainingOptions(overlap_p2p_comm=flag))
             for flag in (True, False)]  # fmt: skip
    assert plain[0].total == plain[1].total


def test_recompute_reruns_the_layers_forward_and_selective_what_the_framework_drops():
    """Full recomputation re-runs every layer's forward (not the embedding and LM head) and
    its two TP collectives; Megatron's selective only the core attention; torchtitan's op-level
    selective everything but the attention and every odd-numbered matmul of a layer."""
    s = ParallelStrategy(1, 2, 1, 1, 1)
    p = get_precision("bf16-mixed")

    def work(**kw):
        return step_work(LLAMA, s, p, H100, TrainingOptions(**kw))

    none, full = work(), work(recompute="full")
    # a layer's records repeat num_layers times, the head's once; the layers come first
    counts = {id(r): n for r, n in full.fwd_bwd.unique()}
    layers = [r for r in full.fwd_bwd.records
              if r.phase == "forward" and counts[id(r)] == LLAMA.num_layers]
    layer = layers[:len(layers) // LLAMA.num_layers]
    assert not none.recompute.records
    assert full.recompute.records == layer * LLAMA.num_layers
    forward = [r for r in full.fwd_bwd.records if r.phase == "forward"]
    assert full.recompute.total() < sum(r.flops for r in forward)  # the head is not re-run
    assert full.tp_collectives == 6 * LLAMA.num_layers and none.tp_collectives == 4 * LLAMA.num_layers
    megatron = work(recompute="selective")
    assert megatron.recompute.records and {r.op_class for r in megatron.recompute.records} == {
        "attention"}
    titan = work(recompute="selective", framework="torchtitan").recompute.records
    mms = [r for r in layer if r.op_class == "matmul"]
    assert [r for r in titan if r.op_class == "matmul"] == mms[1::2] * LLAMA.num_layers
    assert not [r for r in titan if r.op_class == "attention"]
    others = [r for r in layer if r.op_class not in ("matmul", "attention")]
    assert [r for r in titan if r.op_class not in ("matmul", "attention")] == (
        others * LLAMA.num_layers)
    # the iteration prices what is re-run on top of the micro-batch's compute
    t_none = iteration_time(none, s, H100)
    for w, mode in ((full, "full"), (megatron, "selective")):
        b = iteration_time(w, s, H100, TrainingOptions(recompute=mode))
        assert b.recompute_mb > 0
        assert b.compute_mb == pytest.approx(t_none.compute_mb + b.recompute_mb)
    with pytest.raises(StrategyError, match="recompute='partial'"):
        TrainingOptions(recompute="partial")


def test_compiled_scales_only_the_elementwise_kernels():
    s = ParallelStrategy(1, 1, 1, 1, 1)
    work = _toy_work()
    dev = replace(H100, efficiency={"compiled": 0.5})
    eager = iteration_time(work, s, dev)
    comp = iteration_time(work, s, dev, TrainingOptions(compiled=True))
    # GEMMs and the fused attention kernel are already single kernels: compile leaves them
    fused = iteration_time(StepWork(Trace([r for r in work.fwd_bwd.records
                                           if r.op_class != "elementwise"]), Trace()), s, dev)  # fmt: skip
    rest = eager.compute_mb - fused.compute_mb
    assert rest > 0
    assert comp.compute_mb == pytest.approx(fused.compute_mb + 0.5 * rest)


def _op_flops(work: StepWork, op_class: str) -> float:
    return sum(r.flops for r in work.fwd_bwd.records if r.op_class == op_class)


def test_context_parallel_splits_gemms_by_cp_and_attention_by_cp_with_full_context():
    p = get_precision("bf16-mixed")
    one = step_work(LLAMA, ParallelStrategy(1, 1, 1, 1, 1), p, H100)
    cp4 = step_work(LLAMA, ParallelStrategy(1, 1, 1, 1, 1, cp=4), p, H100)
    # each rank: a quarter of the tokens through every GEMM; its quarter of the queries
    # against all keys: a quarter of the attention FLOPs, not a sixteenth
    layer_gemm = _op_flops(one, "matmul")
    assert _op_flops(cp4, "matmul") == pytest.approx(layer_gemm / 4, rel=1e-6)
    assert _op_flops(cp4, "attention") == pytest.approx(_op_flops(one, "attention") / 4,
                                                        rel=1e-6)  # fmt: skip
    head_dim = LLAMA.hidden_size // LLAMA.num_attention_heads
    kv_block = 2 * (LLAMA.seq_length // 4) * LLAMA.kv_heads * head_dim * 2  # K,V in bf16
    assert cp4.cp_sends == 3 * 3 * LLAMA.num_layers  # (cp-1) K,V fwd; K,V + dK,dV bwd
    assert cp4.cp_bytes == pytest.approx(cp4.cp_sends * kv_block)
    assert one.cp_bytes == 0


def test_context_parallel_ring_and_gradient_group():
    s = ParallelStrategy(2, 1, 1, 1, 2, cp=4)
    assert s.world_size == 8 and s.name == "dp2tp1pp1cp4mb1gb2"
    assert ParallelStrategy.parse(s.name) == s
    work = step_work(LLAMA, s, get_precision("bf16-mixed"), H100)
    zero1 = TrainingOptions(distributed_optimizer=True)
    b = iteration_time(work, s, H100, zero1)
    plain = iteration_time(work, ParallelStrategy(8, 1, 1, 1, 8), H100, zero1)
    assert b.cp_comm_mb >= 0 and b.intra_bytes > 0
    # the optimizer state is sharded over DP x CP = 8 ranks, as with DP = 8
    assert b.optimizer == pytest.approx(plain.optimizer * _opt(work) / _opt(
        step_work(LLAMA, ParallelStrategy(8, 1, 1, 1, 8), get_precision("bf16-mixed"), H100)))


def _opt(work: StepWork) -> float:
    return sum(r.bytes for r in work.optimizer.records)


def test_context_parallel_bad_input_names_the_field():
    with pytest.raises(StrategyError, match="cp=3 needs 2\\*cp dividing seq_length=256"):
        ParallelStrategy(1, 1, 1, 1, 1, cp=3).check(3, LLAMA)
    unfused = replace(LLAMA, attention="unfused")
    with pytest.raises(StrategyError, match="cp=2 needs attention='flash'"):
        ParallelStrategy(1, 1, 1, 1, 1, cp=2).check(2, unfused)
    with pytest.raises(StrategyError, match="cp=0"):
        ParallelStrategy(1, 1, 1, cp=0)


def test_sequence_parallel_shards_the_norms_not_the_gemms():
    """Megatron's --sequence-parallel: norms, dropout and residual adds run on seq / tp tokens,
    the GEMMs and attention on the gathered sequence (unchanged), the pipeline sends a shard."""
    gpt = TransformerSpec("gpt", 4, 256, 4, 256, 1024)
    s = ParallelStrategy(1, 4, 2, 1, 4)
    p = get_precision("bf16-mixed")
    plain = step_work(gpt, s, p, H100)
    sp = step_work(gpt, s, p, H100, TrainingOptions(sequence_parallel=True))

    def total(work, op_class, attr):
        return sum(getattr(r, attr) for r in work.fwd_bwd.records if r.op_class == op_class)

    for op_class in ("matmul", "attention"):
        assert total(sp, op_class, "flops") == pytest.approx(total(plain, op_class, "flops"))
    norms = [r for r in plain.fwd_bwd.records if "layer_norm" in r.name]
    sp_norms = [r for r in sp.fwd_bwd.records if "layer_norm" in r.name]
    # the embedding/head shard's final norm is not sequence-parallel: one norm of 2 L + 1,
    # L = 2 layers on the (critical) stage
    layer_bytes = sum(r.bytes for r in norms) * 2 * 2 / (2 * 2 + 1)
    head_bytes = sum(r.bytes for r in norms) - layer_bytes
    assert sum(r.bytes for r in sp_norms) == pytest.approx(layer_bytes / 4 + head_bytes, rel=0.02)
    assert sp.pp_bytes == pytest.approx(plain.pp_bytes / 4)
    assert sp.tp_bytes == pytest.approx(plain.tp_bytes)  # all-gather + reduce-scatter
    # tp = 1: the flag changes nothing
    one = ParallelStrategy(4, 1, 2, 1, 8)
    assert (step_work(gpt, one, p, H100, TrainingOptions(sequence_parallel=True)).fwd_bwd.total()
            == step_work(gpt, one, p, H100).fwd_bwd.total())


def test_sequence_parallel_needs_the_sequence_to_split_over_tp():
    odd = TransformerSpec("gpt", 4, 256, 4, 250, 1024)
    with pytest.raises(StrategyError, match="sequence_parallel"):
        step_work(odd, ParallelStrategy(1, 4, 1, 1, 1), get_precision("bf16-mixed"), H100,
                  TrainingOptions(sequence_parallel=True))


def test_fsdp_communication_hides_only_its_fitted_share_under_compute():
    """Unfitted, FSDP's per-micro-batch gathers and reduce-scatters hide whole under compute;
    with a fitted share ``overlap:fsdp`` the rest of them stays exposed."""
    s = ParallelStrategy(8, 1, 1, 1, 8)
    options = TrainingOptions(fsdp=True)
    work = step_work(LLAMA, s, get_precision("bf16-mixed"), H100, options)
    whole = iteration_time(work, s, H100, options)
    share = replace(H100, efficiency={"overlap:fsdp": 0.6})
    part = iteration_time(work, s, share, options)
    comm = iteration_time(work, s, replace(H100, efficiency={"overlap:fsdp": 0.0}),
                          options).fsdp_comm_mb  # nothing hidden: all of it
    assert comm > 0 and whole.fsdp_comm_mb == pytest.approx(max(0.0, comm - whole.compute_mb))
    assert part.fsdp_comm_mb == pytest.approx(max(comm - whole.compute_mb, 0.4 * comm))
    assert part.total > whole.total


def test_fp32_attention_runs_the_3xtf32_kernel_in_fp32_and_tf32_runs_alike():
    """SDPA on fp32 operands is the memory-efficient kernel's 3xTF32 on sm80+ (three TF32 MMAs
    per product, whatever allow_tf32 says): a third of the tf32 peak under ``attention:tf32``;
    a GPU without tf32 tensor cores keeps the fp32 rate."""
    from predictors.time.analytical import GPU_KERNEL_GAP, op_time

    flops = 3e12

    def attention(dclass: str) -> OpRecord:
        return OpRecord("attn", "forward", "attention", "float32", dclass, (), (), flops, 1e6,
                        dclass == "tf32")  # fmt: skip

    dev = replace(H100, efficiency={"attention:tf32": 0.4})
    want = flops / (H100.peak_flops["tf32"] / 3 * 0.4) + GPU_KERNEL_GAP
    assert op_time(attention("fp32"), dev) == pytest.approx(want)
    assert op_time(attention("tf32"), dev) == pytest.approx(want)
    # a GEMM keeps its own column: fp32 stays on CUDA cores, tf32 at the full tf32 rate
    gemm = replace(attention("tf32"), op_class="matmul")
    assert op_time(gemm, dev) < op_time(replace(gemm, dtype_class="fp32"), dev)
    v100 = get_device("v100")
    assert op_time(attention("fp32"), v100) == pytest.approx(
        flops / (v100.peak_flops["fp32"] * 0.5) + GPU_KERNEL_GAP)


def test_fp32_and_tf32_runs_fit_one_attention_key():
    from predictors.time.efficiency import attention_key

    keys = {attention_key(get_precision(p)) for p in ("fp32", "tf32")}
    assert keys == {"attention:tf32"}
    assert attention_key(get_precision("bf16-mixed")) == "attention:bf16"


def test_tp_overlap_hides_only_its_fitted_share_under_the_gemms():
    """Unfitted, TP overlap hides the TP collectives whole under the layer's GEMMs; with a
    fitted share ``overlap:tp`` the rest stays exposed, never more than without overlap."""
    s = ParallelStrategy(1, 2, 1, 1, 1)
    plain = TrainingOptions(sequence_parallel=True)
    overlap = TrainingOptions(sequence_parallel=True, tp_comm_overlap=True)
    work = step_work(LLAMA, s, get_precision("bf16-mixed"), H100, overlap)
    comm = iteration_time(work, s, H100, plain).tp_comm_mb
    whole = iteration_time(work, s, H100, overlap)
    part = iteration_time(work, s, replace(H100, efficiency={"overlap:tp": 0.6}), overlap)
    gemms = sum(n * t for r, n, t in priced(work.fwd_bwd, H100) if r.op_class == "matmul")
    assert comm > 0 and whole.tp_comm_mb == pytest.approx(max(0.0, comm - gemms))
    assert part.tp_comm_mb == pytest.approx(max(comm - gemms, 0.4 * comm))
    none = iteration_time(work, s, replace(H100, efficiency={"overlap:tp": 0.0}), overlap)
    assert none.tp_comm_mb == pytest.approx(comm)


def test_tp_overlap_share_is_each_frameworks_own():
    """Each framework's TP overlap is its own implementation: its fitted share prices its runs
    only, and a framework without one (new, or held out) hides all of it."""
    from predictors.time.efficiency import resolve, tp_overlap_key

    fitted = {"matmul:bf16": 0.6, tp_overlap_key("torchtitan"): 0.4}
    assert resolve(fitted, "torchtitan") == {"matmul:bf16": 0.6, "overlap:tp": 0.4}
    assert resolve(fitted, "megatron") == {"matmul:bf16": 0.6}
