"""Strategy switch in memory (megatron_cona.reshard) vs. through a megatron-core checkpoint.

On N CPU gloo ranks, a GPT (default ~135M parameters: fp32 weights, grads and Adam state fill
~2 GiB per layout across the ranks) trains one step in the source layout, then switches to the
target layout twice from the same state:

(a) in memory: ``switch_strategy`` — builds the new layout and streams weights, fp32 main
    weights and Adam moments over the process group in buckets;
(b) checkpoint: ``megatron.core.dist_checkpointing.save`` of model + optimizer to /dev/shm,
    build the new layout, ``dist_checkpointing.load`` with the new layout's sharded state dict.

Both results are checked to give the same validation loss.  Bytes written are measured as the
growth of the benchmark's /dev/shm dir (also the ranks' temp and working dir) per path.  The last line is
``ratio_vs_checkpoint=<(b) seconds / (a) seconds> bytes_written=<bytes written by (a)>``.

Usage: .venv/bin/python benchmarks/bench_reshard.py [--hidden 1024 --layers 8 --vocab 32000
       --source dp1tp2pp2 --target dp1tp4pp1 --world 4 --bucket-mib 64]
Uses the Adam (non-distributed) optimizer: megatron-core 0.16.1's DistributedOptimizer
'fully_reshardable' checkpoint cannot be loaded with torch's Adam (KeyError 'step').
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_cpu.launch import run_distributed  # noqa: E402


def _tree_bytes(paths: list[str]) -> int:
    total = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
    return total


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench_reshard] {msg}", flush=True)


def _sharded_state_dict(state, loading: bool) -> dict:
    from megatron_cona.parallel import megatron_globals

    with megatron_globals(state.groups):
        model_sd = state.core_model.sharded_state_dict()
        return {"model": model_sd,
                "optimizer": state.optimizer.sharded_state_dict(model_sd, is_loading=loading)}


def _checkpoint_switch(state, cfg, target, ckpt_dir: str):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_cona.parallel import megatron_globals
    from megatron_cona.reshard import optimizer_state
    from megatron_cona.runtime import build_state

    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    with megatron_globals(state.groups):
        dist_checkpointing.save(_sharded_state_dict(state, False), ckpt_dir)
    dist.barrier()
    new = build_state(cfg, target, iteration=state.iteration,
                      consumed_samples=state.consumed_samples, initialize=False)
    kinds, step, in_groups = optimizer_state.adam_kinds(state)
    optimizer_state.init_optimizer_state(new, kinds, step, in_groups)
    with megatron_globals(new.groups):
        loaded = dist_checkpointing.load(_sharded_state_dict(new, True), ckpt_dir)
        new.core_model.load_state_dict(loaded["model"])
        new.optimizer.load_state_dict(loaded["optimizer"])
    optimizer_state.copy_scalar_state(state, new)
    dist.barrier()
    return new


def _rank(rank: int, world: int, args: argparse.Namespace, shm_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_cona.runtime import (
        TokenDataset,
        TrainConfig,
        build_state,
        evaluate,
        switch_strategy,
        train_step,
    )
    from predictors.spec import ParallelStrategy, TransformerSpec

    spec = TransformerSpec("gpt", num_layers=args.layers, hidden_size=args.hidden,
                           num_attention_heads=args.heads, seq_length=args.seq,
                           vocab_size=args.vocab)
    cfg = TrainConfig(spec, precision=args.precision)
    data = TokenDataset(torch.randint(0, spec.vocab_size, (200_000,),
                                      generator=torch.Generator().manual_seed(0)), spec.seq_length)
    source, target = ParallelStrategy.parse(args.source), ParallelStrategy.parse(args.target)
    _log(rank, f"{spec.num_parameters() / 1e6:.0f}M parameters; building {source.name}")
    state = build_state(cfg, source)
    train_step(state, data)
    state_bytes = sum(p.numel() * p.element_size() * 4 for p in state.core_model.parameters())
    total = torch.tensor([state_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    _log(rank, f"source state (weights+grads+Adam) {total.item() / 2**30:.2f} GiB over {world} "
               f"ranks; checkpoint path -> {shm_dir}")
    # Private temp and working dirs inside the watched dir: other processes' files don't count.
    private = os.path.join(shm_dir, f"work{rank}")
    os.makedirs(private, exist_ok=True)
    os.chdir(private)
    tempfile.tempdir = private
    watched = [shm_dir]

    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401 - untimed imports

    dist.barrier()
    before = _tree_bytes(watched)
    t0 = time.perf_counter()
    via_ckpt = _checkpoint_switch(state, cfg, target, os.path.join(shm_dir, "ckpt"))
    ckpt_seconds = time.perf_counter() - t0
    ckpt_written = _tree_bytes(watched) - before
    loss_ckpt = evaluate(via_ckpt, data, 50_000, target.dp * target.micro_batch * 2)
    via_ckpt.destroy()
    del via_ckpt
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(shm_dir, "ckpt"), ignore_errors=True)
    dist.barrier()
    _log(rank, f"(b) checkpoint save+load: {ckpt_seconds:.2f}s, {ckpt_written / 2**20:.0f} MiB "
               "written")

    before = _tree_bytes(watched)
    t0 = time.perf_counter()
    result = switch_strategy(state, target, bucket_bytes=args.bucket_mib * 2**20)
    mem_seconds = time.perf_counter() - t0
    mem_written = _tree_bytes(watched) - before
    if not result.switched:
        raise RuntimeError(f"in-memory switch failed: {result.error}")
    loss_mem = evaluate(result.state, data, 50_000, target.dp * target.micro_batch * 2)
    _log(rank, f"(a) in-memory switch: {mem_seconds:.2f}s, {result.num_buckets} buckets, "
               f"{result.bytes_total / 2**20:.0f} MiB over the network, peak buffer "
               f"{result.peak_buffer_bytes / 2**20:.1f} MiB/rank; phases "
               + ", ".join(f"{k} {v:.2f}s" for k, v in result.phase_seconds.items()))
    result.state.destroy()
    times = torch.tensor([ckpt_seconds, mem_seconds], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {"ckpt_s": float(times[0]), "mem_s": float(times[1]), "ckpt_written": ckpt_written,
            "mem_written": mem_written, "loss_ckpt": loss_ckpt, "loss_mem": loss_mem,
            "state_gib": total.item() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--source", default="dp1tp2pp2")
    ap.add_argument("--target", default="dp1tp4pp1")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shm_dir = tempfile.mkdtemp(prefix="bench_reshard_", dir=shm_root)
    try:
        results = run_distributed(_rank, args.world, args, shm_dir, timeout=args.timeout)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    r0 = results[0]
    ckpt_written = sum(r["ckpt_written"] for r in results[:1])  # every rank sees the same dirs
    mem_written = max(r["mem_written"] for r in results)
    same = abs(r0["loss_mem"] - r0["loss_ckpt"]) <= 1e-5 * abs(r0["loss_ckpt"])
    print(f"state={r0['state_gib']:.2f}GiB in_memory={r0['mem_s']:.2f}s "
          f"checkpoint={r0['ckpt_s']:.2f}s checkpoint_bytes_written={ckpt_written} "
          f"val_loss in_memory={r0['loss_mem']:.6f} checkpoint={r0['loss_ckpt']:.6f} "
          f"match={same}")
    if not same:
        raise SystemExit("in-memory and checkpoint switches disagree")
    print(f"ratio_vs_checkpoint={r0['ckpt_s'] / r0['mem_s']:.2f} bytes_written={mem_written}")


if __name__ == "__main__":
    main()
