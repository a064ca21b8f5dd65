"""Pretrain a GPT with megatron-core, optionally with CONA (``--cona``).

    torchrun --nproc-per-node 8 -m megatron_cona.pretrain_gpt \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 \\
        --micro-batch-size 4 --global-batch-size 64 --train-iters 5000 --lr 3e-4 --bf16 \\
        --tensor-model-parallel-size 2 --cona --cona-global-batch-range 16,256 \\
        --cona-log cona.jsonl

Megatron-LM's ``pretrain()`` asserts CUDA and keeps model and optimizer inside ``train()``, so
this loop is built on megatron-core's own pieces (``megatron_cona.runtime``). Argument names and
defaults follow Megatron-LM for the subset used, with two differences: ``--distributed-backend``
defaults to nccl with GPUs and gloo without, and the data is byte-level text
(``--data-path``: a directory of ``*.py`` sources; default this Python's standard library).
Without ``--cona`` it trains the static strategy the parallelism flags give. On CPU-only
machines launch through ``scripts/cona_cpu.py pretrain ...`` (megatron-core needs its hard-coded
CUDA calls redirected there, which the plugin itself never does).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_cona.arguments import (
    ConaArgumentError,
    add_cona_args,
    precision_from_args,
    static_strategy,
)
from megatron_cona.data import VOCAB_SIZE, CorpusConfig, build_corpus
from predictors.spec import TransformerSpec
from predictors.spec.engines import text_spec_from_megatron_args

log = logging.getLogger("megatron_cona.pretrain_gpt")


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); names the iteration."""


def _megatron_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--seed", type=int, default=1234)
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g = parser.add_argument_group(title="logging and validation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g = parser.add_argument_group(title="data")
    g.add_argument("--data-path", type=str, default=None)
    g.add_argument("--split-val-fraction", type=float, default=0.05)


def parse_args(argv: Sequence[str] | None = None,
               extra_args_provider: Callable | None = None,
               ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Megatron-LM's ``parse_args`` contract for the subset of flags this loop uses."""
    parser = argparse.ArgumentParser(description="Megatron-Core GPT pretraining with CONA",
                                     allow_abbrev=False)
    _megatron_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    return args


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise ConaArgumentError("--" + name.replace("_", "-"), "is required")


def model_spec(args: argparse.Namespace) -> TransformerSpec:
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size", "train_iters", "lr")
    if args.max_position_embeddings not in (None, args.seq_length):
        raise ConaArgumentError("--max-position-embeddings",
                                f"{args.max_position_embeddings} != --seq-length {args.seq_length}")
    if args.bf16 and args.fp16:
        raise ConaArgumentError("--fp16", "cannot be combined with --bf16")
    return text_spec_from_megatron_args(args, vocab_size=VOCAB_SIZE)


def init_distributed(backend: str | None) -> None:
    """The torchrun world (RANK/WORLD_SIZE/MASTER_*), NCCL with GPUs and gloo without."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:  # plain `python -m`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


@dataclass
class RunSummary:
    """What a run did, identical on every rank."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    timeline: list[tuple[int, str]] = field(default_factory=list)  # (first iteration, strategy)
    switches: list[dict] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    build_seconds: float = 0.0  # the start's state build (slowest rank): a layout switch's prior


def train(args: argparse.Namespace) -> RunSummary:
    """Run the configured training on the current world; returns the run summary."""
    from megatron_cona import runtime
    from megatron_cona.arguments import validate_cona_args
    from megatron_cona.runtime.executor import RuntimeExecutor, max_over_world
    from megatron_cona.session import session_from_args

    init_distributed(args.distributed_backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = model_spec(args)
    start = static_strategy(args, world)
    settings = validate_cona_args(args, world, spec)  # also checks the static strategy
    if args.global_batch_size is None:
        args.global_batch_size = start.global_batch_size
    corpus = build_corpus(CorpusConfig(seq_length=args.seq_length, data_path=args.data_path,
                                       val_fraction=args.split_val_fraction, seed=args.seed))
    gb = start.global_batch_size
    cfg = runtime.TrainConfig(
        model=spec, precision=precision_from_args(args),
        distributed_optimizer=args.use_distributed_optimizer, lr=args.lr, min_lr=args.min_lr,
        lr_warmup_samples=args.lr_warmup_iters * gb,
        lr_decay_samples=(args.lr_decay_iters or args.train_iters) * gb,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, dropout=args.hidden_dropout,
        init_method_std=args.init_method_std, seed=args.seed,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    built = time.perf_counter()
    executor = RuntimeExecutor(runtime.build_state(cfg, start))
    summary = RunSummary(timeline=[(0, start.name)],
                         build_seconds=max_over_world(time.perf_counter() - built))
    session = (session_from_args(args, settings, spec, world, cfg.precision, executor,
                                 write_log=rank == 0, build_seconds=summary.build_seconds)
               if args.cona else None)

    def record_switches(it: int, since: int) -> None:
        for record in session.switches[since:]:
            if record.outcome.switched:
                summary.timeline.append((it, record.new.name))
                summary.switches.append({"iteration": it, "from": record.old.name,
                                         "to": record.new.name,
                                         "seconds": record.outcome.seconds,
                                         "moved_tensors": record.outcome.moved_tensors})
    if session is not None:
        session.begin()
        record_switches(0, 0)
    for it in range(1, args.train_iters + 1):
        state = executor.state
        t0 = time.perf_counter()
        result = runtime.train_step(state, corpus.train, grad_stats=session is not None)
        seconds = max_over_world(time.perf_counter() - t0)
        if not math.isfinite(result.loss):
            raise TrainingError(f"iteration {it}: loss={result.loss} under {state.strategy.name}")
        summary.losses.append(result.loss)
        summary.seconds.append(seconds)
        if rank == 0 and (it % args.log_interval == 0 or it == 1):
            log.info("iteration %d/%d | %s | lm loss %.4f | lr %.3g | %.1f ms", it,
                     args.train_iters, state.strategy.name, result.loss, result.lr,
                     1e3 * seconds)
        if args.eval_interval and it % args.eval_interval == 0:
            step = state.strategy.dp * state.strategy.micro_batch
            count = min(args.eval_iters * state.strategy.global_batch_size, len(corpus.valid))
            val = runtime.evaluate(state, corpus.valid, 0, max(step, count // step * step))
            summary.val_losses.append((it, val))
            if rank == 0:
                log.info("validation at iteration %d | lm loss %.4f | ppl %.2f", it, val,
                         math.exp(min(val, 50)))
        if session is None:
            continue
        switches = len(session.switches)
        session.after_step(it, seconds, result.grad_stats, final=it == args.train_iters,
                           loss=result.loss)
        record_switches(it, switches)
    state = executor.state
    state.destroy()
    return summary


def main(argv: Sequence[str] | None = None) -> RunSummary:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv, extra_args_provider=add_cona_args)
    summary = train(args)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
