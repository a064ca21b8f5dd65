#!/usr/bin/env python
"""GPU validation kit: measure everything the predictors and plugins need on a lent GPU.

    python3 scripts/gpu_check.py --out $OUT                 # on the GPU machine (<= 8 min)
    python scripts/gpu_check.py --dry-run --out out/gpu-check  # same harness, CPU, tiny sizes

Before a GPU run, `scripts/gpu_carry.sh` fetches what the machine lacks into .gpu-carry/ (used
automatically when present). Parts, files and how to fold the results into predictors/data/:
docs/gpu-check.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpucheck.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
