"""(4) megatron-core on the GPU through CONA's runtime: a ``GPTModel`` (local layer spec,
megatron DDP, megatron's Adam with fp32 main weights) trained for a few iterations over NCCL in
a 1-rank world, a global-batch switch (CONA's transactional ``switch_strategy``), and the reshard
code path a 1-rank world has (a fresh state of the same layout filled by ``transfer_state``),
checked tensor by tensor, then trained on. Then timed Megatron-Core steps at TP 1 and 2 (fp8
where Transformer Engine and the runtime run it, else bf16) beside the time predictor's answer
for framework ``megatron``: the Megatron rows of the time predictor's development data.

The dry run runs the same sequence on gloo with megatron-core's hard-coded CUDA calls
redirected to the CPU (``megatron_cpu``, the CPU launcher's redirect; the plugin never imports
it). In a 1-rank world every copy is local (``bytes_total`` counts remote bytes: 0); the check is
that the destination, built without weight init, equals the source bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

from gpucheck import adapters
from gpucheck.common import Budget, PartContext, RowWriter, error_text

FILE = "megatron.csv"
ERROR_ROW = {"event": "part", "strategy": "-"}
# (layers, hidden, heads, seq, vocab, precision, bucket bytes)
GPU_MODEL = (4, 1024, 16, 1024, 32000, "bf16-mixed", 8 * 2**20)
DRY_MODEL = (2, 32, 4, 16, 64, "fp32", 16 * 2**10)
START, SWITCHED = "dp1tp1pp1mb2gb8", "dp1tp1pp1mb2gb16"
# Timed Megatron-Core steps, the time predictor's ground truth for framework "megatron" (#44):
# shapes (family, layers, hidden, heads, seq, vocab) x strategies at TP 1 and 2, each
# (warm-up, timed) iterations; a TP = 2 world is two ranks (spawned, gloo) on a CPU dry run
GPU_TIME_SHAPES = (("gpt", 4, 2048, 16, 2048, 32000), ("llama", 4, 2048, 16, 2048, 32000),
                   ("gpt", 2, 4096, 32, 2048, 32000))  # fmt: skip
DRY_TIME_SHAPES = (("gpt", 2, 32, 4, 16, 64),)
TIME_STRATEGIES = ((1, "dp1tp1pp1mb2gb8"), (2, "dp1tp2pp1mb2gb8"))  # (ranks, strategy)
GPU_STEPS, DRY_STEPS = (2, 6), (1, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(ctx: PartContext, cfg, data, losses: list[float], budget: Budget,
               w: RowWriter, base: dict) -> bool:
    """The same schedule again from a fresh build, without the reshard: the losses after the
    reshard must equal these (the same weights, data and kernels)."""
    budget.check("the reference run", reserve=5.0)
    state = adapters.cona_build(cfg, START)
    ref = [adapters.cona_train_step(state, data)["loss"] for _ in range(2 if ctx.dry_run else 3)]
    state, _ = adapters.cona_switch(state, SWITCHED)
    ref += [adapters.cona_train_step(state, data)["loss"]
            for _ in range(len(losses) - len(ref))]
    state.destroy()
    same = all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(losses, ref, strict=True))
    w.write(event="reference_without_reshard", strategy=SWITCHED, iteration=len(ref), loss=ref[-1],
            seconds=0, status="ok" if same else "error",
            detail={"losses": [round(x, 5) for x in ref],
                    "with_reshard": [round(x, 5) for x in losses]},
            note="" if same else "the losses after the reshard differ from the run without it",
            **base)
    return same


def time_steps(cfg, strategy: str, steps: tuple[int, int], on_gpu: bool) -> dict:
    """Build a Megatron-Core state through CONA's runtime, run ``steps[0]`` warm-up and
    ``steps[1]`` timed iterations (wall clock, CUDA synchronised on a GPU): {"times", "loss"}.
    Runs on every rank of the world the strategy needs."""
    import torch

    data = adapters.cona_token_dataset(cfg.model.vocab_size, cfg.model.seq_length)
    state = adapters.cona_build(cfg, strategy)
    times, loss = [], math.nan
    try:
        for i in range(sum(steps)):
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = adapters.cona_train_step(state, data)["loss"]
            if on_gpu:
                torch.cuda.synchronize()
            if i >= steps[0]:
                times.append(time.perf_counter() - t0)
    finally:
        state.destroy()
    return {"times": times, "loss": loss}


def _rank_time_steps(rank: int, world_size: int, cfg, strategy: str,
                     steps: tuple[int, int]) -> dict:  # fmt: skip
    """One rank of a multi-rank dry run (``megatron_cpu.launch.run_distributed``)."""
    return time_steps(cfg, strategy, steps, on_gpu=False)


def timed_steps(ctx: PartContext, w: RowWriter, budget: Budget, backend: str) -> dict:
    """One ``timed_step`` row per shape and strategy: the 20 % quantile of the timed iterations
    in ``seconds``; the time predictor's answer (framework ``megatron``) in ``detail``."""
    import torch

    on_gpu = ctx.device == "cuda"
    precision, why = adapters.cona_step_precision(on_gpu)
    steps = GPU_STEPS if on_gpu else DRY_STEPS
    device = adapters.time_device(ctx.device)
    summary: dict = {"precision": precision, "why": why, "ok": 0, "errors": [], "pred_error_pct": []}
    for shape in GPU_TIME_SHAPES if on_gpu else DRY_TIME_SHAPES:
        spec = adapters.megatron_runtime_spec(*shape)
        cfg = adapters.cona_train_config(spec, precision)
        for ranks, strategy in TIME_STRATEGIES:
            budget.check(f"the timed steps of {strategy}", reserve=5.0)
            row = {"event": "timed_step", "strategy": strategy, "precision": precision,
                   "backend": backend}
            detail = {"spec": json.loads(adapters.spec_row(spec)[1]), "framework": "megatron",
                      "ranks": ranks, "precision_note": why, "warmup": steps[0]}
            if on_gpu and ranks > 1:
                w.write(**row, seconds=0, status="skipped", detail=detail,
                        note=f"tp=2 needs {ranks} GPUs in one NCCL world (NCCL refuses two "
                             f"ranks on one device); this machine has "
                             f"{torch.cuda.device_count()}")  # fmt: skip
                continue
            t0 = time.perf_counter()
            try:
                if ranks == 1:
                    res = time_steps(cfg, strategy, steps, on_gpu)
                else:
                    from megatron_cpu.launch import run_distributed

                    res = run_distributed(_rank_time_steps, ranks, cfg, strategy, steps,
                                          timeout=max(budget.left() - 5.0, 1.0))[0]  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded as a row; the next point runs
                summary["errors"].append(f"{shape} {strategy}")
                w.write(**row, seconds=0, status="error", detail=detail, note=error_text(exc))
                continue
            times = sorted(res["times"])
            seconds = times[int(0.2 * len(times))]
            detail.update(times=res["times"], median_s=times[len(times) // 2],
                          min_s=times[0], wall_s=time.perf_counter() - t0)
            try:
                pred = adapters.predict_megatron_time(spec, strategy, precision, device)
                err = 100.0 * (pred["seconds"] - seconds) / seconds
                detail.update(pred_seconds=pred["seconds"], pred_error_pct=err,
                              pred_device=pred["device"],
                              pred_note="calibrated" if pred["calibrated"] else "analytical only")
                summary["pred_error_pct"].append(round(err, 1))
            except Exception as exc:  # noqa: BLE001 - the measurement stands without it
                detail["pred_note"] = f"prediction failed: {error_text(exc, 200)}"
            ok = math.isfinite(res["loss"])
            summary["ok"] += ok
            w.write(**row, iteration=len(times), loss=res["loss"], seconds=seconds,
                    status="ok" if ok else "error", detail=detail,
                    note=("" if on_gpu else "cpu dry run: host wall clock, tiny model")
                    + ("" if ok else " non-finite loss"))  # fmt: skip
    return summary


def run(ctx: PartContext, w: RowWriter, budget: Budget) -> dict:
    import torch
    import torch.distributed as dist

    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        w.write(event="import", strategy="-", seconds=0, backend="-",
                status="skipped" if ctx.dry_run else "error",
                note=f"megatron-core not importable ({exc}); carry it with scripts/gpu_carry.sh")
        return {"_status": "skipped" if ctx.dry_run else "error"}
    if ctx.device == "cuda":
        torch.cuda.set_device(0)
        backend = "nccl"
    else:
        from megatron_cpu.cuda_redirect import install

        install()
        backend = "gloo"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    layers, hidden, heads, seq, vocab, precision, bucket = DRY_MODEL if ctx.dry_run else GPU_MODEL
    spec = adapters.transformer_spec("gpt", layers, hidden, heads, seq, vocab)
    cfg = adapters.cona_train_config(spec, precision)
    data = adapters.cona_token_dataset(vocab, seq)
    base = {"backend": backend, "precision": precision}
    losses: list[float] = []
    summary: dict = {"backend": backend}

    def sync():
        if ctx.device == "cuda":
            torch.cuda.synchronize()

    def train(state, n: int, event: str) -> None:
        for _ in range(n):
            budget.check(f"a {event} iteration", reserve=3.0)
            t0 = time.perf_counter()
            r = adapters.cona_train_step(state, data)
            sync()
            losses.append(r["loss"])
            ok = math.isfinite(r["loss"])
            w.write(event=event, strategy=r["strategy"], iteration=r["iteration"],
                    loss=r["loss"], seconds=time.perf_counter() - t0,
                    consumed_samples=r["consumed_samples"], status="ok" if ok else "error",
                    note="" if ok else "non-finite loss", **base)

    try:
        t0 = time.perf_counter()
        state = adapters.cona_build(cfg, START)
        sync()
        w.write(event="init", strategy=START, seconds=time.perf_counter() - t0, status="ok",
                detail={"layers": layers, "hidden": hidden, "seq": seq, "vocab": vocab}, **base)
        train(state, 2 if ctx.dry_run else 3, "train")

        t0 = time.perf_counter()
        state, facts = adapters.cona_switch(state, SWITCHED)
        sync()
        ok = facts["switched"] and not facts["moved_tensors"] and state.strategy.name == SWITCHED
        w.write(event="switch_batch", strategy=state.strategy.name,
                seconds=time.perf_counter() - t0, consumed_samples=state.consumed_samples,
                status="ok" if ok else "error", detail=facts,
                note="" if ok else "a batch-only switch must switch and move no tensor", **base)
        summary["switch_batch_ok"] = ok
        before_consumed = state.consumed_samples
        n = 1 if ctx.dry_run else 2
        train(state, n, "train")
        summary["samples_per_step_after_switch"] = (state.consumed_samples - before_consumed) / n

        budget.check("the reshard", reserve=5.0)
        eval_samples = 2 * state.strategy.micro_batch
        eval_before = adapters.cona_evaluate(state, data, eval_samples)
        before = {k: v.detach().clone() for k, v in adapters.cona_state_tensors(state).items()}
        t0 = time.perf_counter()
        state, facts = adapters.cona_reshard_same_layout(state, bucket)
        sync()
        after = adapters.cona_state_tensors(state)
        mismatched = sorted(k for k in before
                            if k not in after or not torch.equal(before[k], after[k]))
        facts.update(tensors=len(before), mismatched=mismatched[:10],
                     bytes_checked=sum(t.numel() * t.element_size() for t in before.values()))
        ok = not mismatched and len(after) == len(before)
        w.write(event="reshard", strategy=state.strategy.name, iteration=state.iteration,
                seconds=time.perf_counter() - t0, consumed_samples=state.consumed_samples,
                status="ok" if ok else "error", detail=facts,
                note="" if ok else "the resharded state differs from the source", **base)
        summary["reshard_exact"] = not mismatched
        del before, after
        # the tensors compared above are what the reshard wrote; the forward must see them too
        eval_after = adapters.cona_evaluate(state, data, eval_samples)
        same = math.isclose(eval_before, eval_after, rel_tol=1e-6)
        w.write(event="forward_after_reshard", strategy=state.strategy.name,
                iteration=state.iteration, loss=eval_after, seconds=0,
                consumed_samples=state.consumed_samples, status="ok" if same else "error",
                detail={"loss_before": eval_before, "loss_after": eval_after,
                        "samples": eval_samples},
                note="" if same else "the resharded model computes another loss", **base)
        summary["forward_same_after_reshard"] = same
        train(state, 1 if ctx.dry_run else 2, "train_after")
        summary["losses"] = [round(x, 4) for x in losses]
        summary["loss_fell"] = losses[-1] < losses[0]
        state.destroy()
        summary["reshard_matches_reference"] = _reference(ctx, cfg, data, losses, budget, w, base)
        summary["timed_steps"] = timed_steps(ctx, w, budget, backend)
    except Exception as exc:  # noqa: BLE001 - recorded as a row; the harness goes on
        w.write(event="error", strategy="-", seconds=0, status="error", note=error_text(exc),
                **base)
        summary["_status"] = "error"
        summary["error"] = error_text(exc)
    finally:
        dist.destroy_process_group()
    return summary
