"""The kernel's page cache dropped before a cold measurement (bench_kvpool, bench_ttft)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the page cache; whether it was dropped: writing
    ``/proc/sys/vm/drop_caches`` needs root, and a run that could not drop it reports its reads
    as not cold rather than failing."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
