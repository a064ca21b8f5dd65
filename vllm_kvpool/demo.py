"""`make demo` step: store and fetch a long-context prefix over a host pool + a file-backed SSD.

Runs the benchmark at a small scale (an 8K-token Llama-3.1-8B-shaped prefix, 1 GiB of KV; host
pool 3/8 of it, the rest on an O_DIRECT file device), checks the fetched KV byte for byte, and
writes the per-device usage plot to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_kvpool.demo",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    from vllm_kvpool.bench import Shape, run

    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    run(Shape(tokens=args.tokens - args.tokens % 256), args.out / "kvpool_demo", 0.375, "uring",
        args.out, log=console.print)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
