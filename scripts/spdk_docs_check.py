#!/usr/bin/env python
"""Run the command block of docs/kvio-spdk.md ("as written:") exactly as the docs give it.

Where SPDK is built (SPDK_DIR, its rpc.py, root for the huge pages), this runs the block with
``<spdk-prefix>`` replaced by SPDK_DIR and ``python``/``pip`` by this interpreter, stopping at
the first failing line:

    SPDK_DIR=/opt/spdk/install .venv/bin/python scripts/spdk_docs_check.py
    .venv/bin/python scripts/spdk_docs_check.py --print     # the block it would run

CI has no SPDK; there tests/kvio/test_spdk_docs.py checks the same block (the paths it names
exist, the flags it passes are the tools' flags, the rebuild keeps the fault injection).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "kvio-spdk.md"
MARKER = "as written:"


def command_block(doc: Path = DOC) -> str:
    """The fenced block that follows the docs' "as written:"."""
    text = doc.read_text()
    start = text.index(MARKER)
    m = re.search(r"```[a-z]*\n(.*?)```", text[start:], re.S)
    if m is None:
        raise ValueError(f"{doc}: no command block after {MARKER!r}")
    return m.group(1)


def runnable(block: str, spdk_dir: str, python: str) -> str:
    """The block with the docs' placeholders bound: SPDK's prefix, this interpreter."""
    block = block.replace("<spdk-prefix>", spdk_dir)
    block = re.sub(r"(?m)^(\s*)pip install", rf"\1{python} -m pip install", block)
    return re.sub(r"(?m)^python ", f"{python} ", block)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the block instead of running it")
    args = ap.parse_args(argv)
    spdk_dir = os.environ.get("SPDK_DIR", "<spdk-prefix>")
    script = runnable(command_block(), spdk_dir, sys.executable)
    if args.print:
        print(script, end="")
        return 0
    if not Path(spdk_dir, "bin", "nvmf_tgt").is_file():
        print(f"spdk_docs_check: SPDK_DIR={spdk_dir!r} has no bin/nvmf_tgt: set SPDK_DIR to the "
              "SPDK install prefix (docs/kvio-spdk.md, Building)", file=sys.stderr)
        return 2
    # The block stops at its first failing line, before its own clean-up: whatever happens, kill
    # the target it started and give back the huge pages and the mount as they were.
    pages_before = Path("/proc/sys/vm/nr_hugepages").read_text().strip()
    mounted_before = "1" if os.path.ismount("/dev/hugepages") else "0"
    try:
        return subprocess.run(["bash", "-euxo", "pipefail", "-c", script], cwd=REPO).returncode
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "spdk_nvmf_target.sh"), "release",
                        pages_before, mounted_before], cwd=REPO)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
