"""Unified KV pool vs serial tiers: fetch a long-context prefix's KV (see vllm_kvpool/bench.py).

    python benchmarks/bench_kvpool.py                 # 32K-token Llama-3.1-8B prefix, 4 GiB
    python benchmarks/bench_kvpool.py --scale 0.125   # 4K tokens, 512 MiB
Last line: ratio_vs_serial=X frac_of_limit=Y
"""

import sys

from vllm_kvpool.bench import main

if __name__ == "__main__":
    sys.exit(main())
