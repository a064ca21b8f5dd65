"""`make demo`: a short showcase of the three plugins on a CPU-only machine.

Each step is a plugin's own command, run as a subprocess so that one plugin's
engine state (vLLM, torch.distributed) never leaks into the next. Plots land in --out. The demo
shows predictions, not evaluations: the predictors' accuracy runs are their benchmarks
(``benchmarks/bench_time_predictor.py``, ``benchmarks/bench_memory_predictor.py``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class DemoStep:
    title: str
    argv: tuple[str, ...]  # run with this interpreter; "{out}" is replaced by the output dir
    log: str  # the step's output is also kept in <out>/<log>
    ok: tuple[int, ...] = (0,)  # exit statuses that are results, not failures


STEPS = (
    DemoStep(
        "predictors: step time across precisions and strategies",
        ("-m", "predictors.cli", "time", "--model", "gpt", "--layers", "24", "--hidden", "2048",
         "--heads", "16", "--seq", "2048", "--strategy", "dp4tp2pp1mb2gb64", "--precision", "all",
         "--device", "a100-80gb", "--out", "{out}/predict_time_demo.json"),
        "time_demo.txt",
    ),
    DemoStep(
        "predictors: peak memory of a LLaVA-1.5-7B-like model on an 80 GiB card",
        ("-m", "predictors.cli", "memory", "--model", "llava-1.5-7b-like", "--batch", "8",
         "--image-res", "336", "--seq", "2048", "--precision", "bf16", "--zero", "1", "--dp", "8",
         "--checkpointing", "full", "--capacity-gib", "80"),
        "memory_demo.txt",
        ok=(0, 3, 2),  # predict memory's verdict: fits, tight, oom (1 is any error)
    ),
    DemoStep(
        "cona: candidate strategies for 8 GPUs ranked with the time predictor (cona plan)",
        ("-m", "megatron_cona.cli", "plan", "--world", "8", "--num-layers", "24",
         "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
         "--global-batch-range", "32,128", "--device", "a100-80gb", "--precision", "bf16-mixed",
         "--top", "8"),
        "cona_plan_demo.txt",
    ),
    DemoStep(
        "kvio: cold reads, io_uring + O_DIRECT vs buffered read()",
        ("benchmarks/bench_kvio.py", "--size-gib", "0.5", "--repeats", "1", "--out", "{out}"),
        "kvio_demo.txt",
    ),
    DemoStep(
        "kvpool: store and fetch a long-context prefix (host pool + SSD file)",
        ("scripts/kvpool_demo.py", "--out", "{out}"),
        "kvpool_demo.txt",
    ),
    DemoStep(
        "cona: strategy chaining on a tiny GPT across 4 gloo ranks",
        ("scripts/cona_cpu.py", "demo", "--out", "{out}"),
        "cona_demo.txt",
    ),
)


def run_step(step: DemoStep, out: Path) -> int:
    argv = [sys.executable, *(a.replace("{out}", str(out)) for a in step.argv)]
    with open(out / step.log, "w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"), help="directory for plots/logs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    results = []
    for i, step in enumerate(STEPS, 1):
        console.rule(f"[bold]{i}/{len(STEPS)} {step.title}")
        start = time.perf_counter()
        rc = run_step(step, args.out)
        results.append((step, rc, time.perf_counter() - start))
    table = Table(title="make demo")
    for col in ("step", "status", "seconds"):
        table.add_column(col)
    for step, rc, secs in results:
        table.add_row(step.title, "ok" if rc in step.ok else f"failed (exit {rc})",
                      f"{secs:.0f}")
    console.print(table)
    plots = sorted(p.name for p in args.out.glob("*.png"))
    console.print(f"plots in {args.out}/: {', '.join(plots) or 'none'}")
    return 0 if all(rc in step.ok for step, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
