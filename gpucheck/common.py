"""Provenance, time budgets and the row writer shared by every part of the kit."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import platform
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_COLUMNS = ("gpu", "driver", "cuda", "torch", "date", "git_commit")
STATUS_VALUES = ("ok", "skipped", "error")
NO_GPU = "skipped: no GPU"


class BudgetExceeded(RuntimeError):
    """A part ran out of its time budget; rows written so far stay."""


@dataclass
class Budget:
    """Seconds a part may spend, counted from construction (``time.monotonic``)."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def expired(self, reserve: float = 0.0) -> bool:
        return self.left() <= reserve

    def check(self, what: str, reserve: float = 0.0) -> None:
        if self.expired(reserve):
            raise BudgetExceeded(f"time budget of {self.seconds:.0f} s spent before {what}")


@dataclass(frozen=True)
class Provenance:
    """Where and when a row was measured: every row of every file carries these columns."""

    gpu: str
    driver: str
    cuda: str
    torch: str
    date: str  # UTC start of the run, ISO 8601
    git_commit: str
    python: str = ""
    host: str = ""

    def columns(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in PROVENANCE_COLUMNS}

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:  # the device machine gets a copy of the tree without .git
        return "unknown (no git)"
    return head + ("+dirty" if dirty else "")


def nvml_info() -> dict[str, Any] | None:
    """Name, driver, memory and clocks of GPU 0 through NVML, or None (no driver/library)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML on CPU machines: a normal answer
        return None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)

        def text(v):
            return v.decode() if isinstance(v, bytes) else str(v)

        def opt(fn, *a):
            try:
                return fn(*a)
            except Exception:  # noqa: BLE001 - a field this driver/VM does not expose
                return None

        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        cuda_drv = opt(pynvml.nvmlSystemGetCudaDriverVersion)
        return {
            "name": text(pynvml.nvmlDeviceGetName(h)),
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": (f"{cuda_drv // 1000}.{cuda_drv % 1000 // 10}" if cuda_drv else None),
            "count": pynvml.nvmlDeviceGetCount(),
            "memory_total": int(mem.total),
            "memory_used": int(mem.used),
            "max_sm_clock_mhz": opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
            "max_mem_clock_mhz": opt(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
            "sm_clock_mhz": opt(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
            "mem_bus_width_bits": opt(pynvml.nvmlDeviceGetMemoryBusWidth, h),
            "power_limit_w": (lambda v: v / 1000 if v else None)(
                opt(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)),
        }
    finally:
        pynvml.nvmlShutdown()


def nvml_used_bytes() -> int | None:
    """Device-level used memory (all processes, CUDA context included), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the column stays empty
        return None


def collect_provenance(dry_run: bool) -> Provenance:
    import torch

    info = nvml_info()  # NVML, not torch: the harness process creates no CUDA context
    if info and torch.cuda.is_available():
        gpu = info["name"]
    elif info:
        gpu = info["name"] + " (torch sees no CUDA device)"
    else:
        gpu = f"none (cpu {'dry run' if dry_run else 'only'}: {platform.processor() or 'x86_64'})"
    return Provenance(
        gpu=gpu,
        driver=(info or {}).get("driver") or "none",
        cuda=torch.version.cuda or "none",
        torch=torch.__version__,
        date=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        git_commit=_git_commit(),
        python=platform.python_version(),
        host=platform.node(),
    )


@dataclass
class PartContext:
    """What the harness hands a part process (serialized to JSON between them)."""

    name: str
    out: str
    dry_run: bool
    device: str  # "cuda" | "cpu"
    budget_s: float
    provenance: dict[str, str]
    workdir: str  # scratch space on the machine's disk (files of the I/O part)
    kvio_prefix: str | None = None  # private prefix with the carried liburing (dpkg -x)
    options: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> PartContext:
        return cls(**json.loads(Path(path).read_text()))


class RowWriter:
    """Appends rows to one CSV of the run, provenance columns filled, flushed row by row (a
    part killed at its time limit keeps what it measured)."""

    def __init__(self, path: Path, columns: Iterable[str], provenance: dict[str, str]) -> None:
        self.path = Path(path)
        self.columns = tuple(columns)
        missing = [c for c in PROVENANCE_COLUMNS if c not in self.columns]
        if missing:
            raise ValueError(f"{self.path.name}: schema lacks provenance columns {missing}")
        self.provenance = {k: provenance[k] for k in PROVENANCE_COLUMNS}
        self.rows = 0
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._f = open(self.path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._w = csv.DictWriter(self._f, fieldnames=self.columns)
        if new:
            self._w.writeheader()
            self._f.flush()

    def write(self, **row: Any) -> None:
        unknown = sorted(set(row) - set(self.columns))
        if unknown:
            raise ValueError(f"{self.path.name}: unknown column(s) {unknown}")
        if row.get("status") not in STATUS_VALUES:
            raise ValueError(f"{self.path.name}: status={row.get('status')!r} must be one of "
                             f"{STATUS_VALUES}")
        clean = {k: _cell(v) for k, v in row.items()}
        self._w.writerow({**clean, **self.provenance})
        self._f.flush()
        self.rows += 1

    def close(self) -> None:
        self._f.close()


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return format(v, ".10g")
    if isinstance(v, dict | list | tuple):
        return json.dumps(v, sort_keys=True, default=str)
    return v


def error_text(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cuda_sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()

