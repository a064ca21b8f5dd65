"""`make demo`: a short showcase of the three plugins on a CPU-only machine.

Each step is the plugin's own demo entry point, run as a subprocess so that one plugin's
engine state (vLLM, torch.distributed) never leaks into the next. Plots land in --out.
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
    module: str  # run as `python -m <module> --out <dir>`


STEPS = (
    DemoStep("predictors: step time across precisions and strategies", "predictors.demo"),
    DemoStep("predictors: peak memory of a LLaVA-like model", "predictors.memory.demo"),
    DemoStep("kvpool: store and fetch a long-context prefix (host pool + SSD file)", "vllm_kvpool.demo"),
    DemoStep("cona: strategy chaining on a tiny GPT across 4 gloo ranks", "megatron_cona.demo"),
)


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
        rc = subprocess.call([sys.executable, "-m", step.module, "--out", str(args.out)])
        results.append((step, rc, time.perf_counter() - start))
    table = Table(title="make demo")
    for col in ("step", "status", "seconds"):
        table.add_column(col)
    for step, rc, secs in results:
        table.add_row(step.title, "ok" if rc == 0 else f"failed (exit {rc})", f"{secs:.0f}")
    console.print(table)
    plots = sorted(p.name for p in args.out.glob("*.png"))
    console.print(f"plots in {args.out}/: {', '.join(plots) or 'none'}")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
