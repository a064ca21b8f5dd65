"""Result files of one run and the schema each must satisfy (checked at the end of every run
and by the tests). A row is ``ok``, ``skipped`` (with the reason in ``note``) or ``error``
(the exception in ``note``); ``ok`` rows must fill their part's measured columns."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from gpucheck.common import PROVENANCE_COLUMNS, STATUS_VALUES

MAX_FILES = 8  # what the device tool brings back from $OUT
MAX_FILE_BYTES = 16 * 2**20
RUN_FILE, LOG_FILE = "run.json", "log.txt"
EVENTS_FILE = "memory_events.jsonl.gz"  # optional: the allocator's events (GPUCHECK_MEMORY_EVENTS)


@dataclass(frozen=True)
class Col:
    name: str
    kind: str  # str | int | float | bool | json
    required_ok: bool = False  # must be non-empty on rows with status ok


def _cols(*cols: Col) -> tuple[Col, ...]:
    return (*cols, Col("status", "str"), Col("note", "str"),
            *(Col(c, "str") for c in PROVENANCE_COLUMNS))


# (1) build of vllm_kvpool._kvio + the transfer engine's GPU path and plain cudaMemcpyAsync.
KVIO = _cols(
    Col("test", "str", True),  # build | fetch | fetch_profile | engine | memcpy | copy_diag | ttft
    Col("path", "str", True),  # e.g. gpu->host_pool, file->gpu, h2d_pinned
    Col("bytes", "int"),
    Col("seconds", "float", True),
    Col("gbps", "float"),
    Col("byte_exact", "bool"),
    Col("repeats", "int"),
    Col("detail", "json"),
)
# (2) memory ground truth; the first columns are predictors/data/memory_ground_truth.csv's.
MEMORY = _cols(
    Col("key", "str", True), Col("ground_truth", "str", True), Col("family", "str", True),
    Col("size", "str", True), Col("model", "str", True), Col("spec", "json"),
    Col("config", "json", True), Col("peak_allocated", "int", True),
    Col("peak_reserved", "int", True), Col("peak_phase", "str"),
    Col("trace_seconds", "float", True),
    Col("optimizer", "str", True), Col("precision", "str", True),
    Col("checkpointing", "str", True), Col("batch", "int", True), Col("params", "int", True),
    Col("nvml_used_before", "int"), Col("nvml_used_peak", "int"),
    Col("pred_peak_reserved", "int"), Col("pred_error_pct", "float"),
    Col("pred_traced_reserved", "int"), Col("pred_traced_error_pct", "float"),
    Col("pred_device_used", "int"), Col("pred_note", "str"),
)
# (3) time ground truth; the first columns are predictors/data/cpu_measurements.csv's.
TIME = _cols(
    Col("model", "str", True), Col("family", "str", True), Col("spec_kind", "str", True),
    Col("spec_json", "json", True), Col("seq", "int", True), Col("precision", "str", True),
    Col("micro_batch", "int", True), Col("dp", "int", True), Col("seconds", "float", True),
    Col("median_s", "float", True), Col("min_s", "float", True), Col("wall_s", "float", True),
    Col("repeats", "int", True), Col("canary_ms", "float", True),
    Col("canary_ratio", "float", True), Col("threads", "int", True),
    Col("timestamp", "float", True), Col("spread_pct", "float", True),
    Col("tflops", "float"), Col("pred_seconds", "float"), Col("pred_analytical_s", "float"),
    Col("pred_device", "str"), Col("pred_error_pct", "float"), Col("pred_note", "str"),
)
# (4) megatron-core GPTModel through CONA's runtime: steps, batch switch, 1-rank reshard.
MEGATRON = _cols(
    # init | train | switch_batch | reshard | forward_after_reshard | train_after |
    # reference_without_reshard | timed_step (seconds: 20 % quantile; detail: times, spec,
    # ranks, the time predictor's pred_seconds / pred_error_pct)
    Col("event", "str", True),
    Col("strategy", "str", True), Col("iteration", "int"), Col("loss", "float"),
    Col("seconds", "float", True), Col("consumed_samples", "int"), Col("backend", "str", True),
    Col("precision", "str"), Col("detail", "json"),
)
# (5) NVML detection into predictors' Device vs the device table entry.
DEVICE = _cols(
    Col("field", "str", True), Col("nvml", "str"), Col("detected", "str"),
    Col("table", "str"), Col("table_key", "str"), Col("match", "bool"),
)

FILES: dict[str, tuple[Col, ...]] = {
    "kvio.csv": KVIO, "memory.csv": MEMORY, "time.csv": TIME, "megatron.csv": MEGATRON,
    "device.csv": DEVICE,
}
ALL_FILES = (RUN_FILE, LOG_FILE, *FILES, EVENTS_FILE)
assert len(ALL_FILES) <= MAX_FILES


def columns(file: str) -> tuple[str, ...]:
    return tuple(c.name for c in FILES[file])


def _parses(kind: str, value: str) -> bool:
    try:
        if kind == "int":
            int(value)
        elif kind == "float":
            float(value)
        elif kind == "bool":
            return value in ("true", "false")
        elif kind == "json":
            json.loads(value)
    except (ValueError, json.JSONDecodeError):
        return False
    return True


def validate_csv(path: Path) -> list[str]:
    """Schema errors of one result CSV (empty list: valid)."""
    spec = FILES[path.name]
    errors: list[str] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != tuple(c.name for c in spec):
            return [f"{path.name}: header {reader.fieldnames} != schema "
                    f"{[c.name for c in spec]}"]
        for i, row in enumerate(reader, start=2):
            where = f"{path.name}:{i}"
            status = row["status"]
            if status not in STATUS_VALUES:
                errors.append(f"{where}: status={status!r} not in {STATUS_VALUES}")
            if status != "ok" and not row["note"]:
                errors.append(f"{where}: a {status} row must say why in note")
            for c in PROVENANCE_COLUMNS:
                if not row[c]:
                    errors.append(f"{where}: provenance column {c} is empty")
            for col in spec:
                value = row[col.name]
                if value == "":
                    if status == "ok" and col.required_ok:
                        errors.append(f"{where}: {col.name} is empty on an ok row")
                    continue
                if not _parses(col.kind, value):
                    errors.append(f"{where}: {col.name}={value!r} is not a {col.kind}")
    return errors


def validate_run(out: Path) -> list[str]:
    """Schema errors of a whole result folder: the file set, sizes, run.json, every CSV."""
    out = Path(out)
    errors: list[str] = []
    present = sorted(p.name for p in out.iterdir() if p.is_file())
    extra = sorted(set(present) - set(ALL_FILES))
    if extra:
        errors.append(f"unexpected files {extra} (the device tool returns at most {MAX_FILES})")
    if len(present) > MAX_FILES:
        errors.append(f"{len(present)} files > {MAX_FILES}")
    for name in present:
        size = (out / name).stat().st_size
        if size > MAX_FILE_BYTES:
            errors.append(f"{name}: {size} bytes > {MAX_FILE_BYTES}")
    run_path = out / RUN_FILE
    if not run_path.exists():
        errors.append(f"{RUN_FILE} missing")
    else:
        run = json.loads(run_path.read_text())
        for key in ("provenance", "parts", "dry_run", "seconds"):
            if key not in run:
                errors.append(f"{RUN_FILE}: key {key!r} missing")
        for c in PROVENANCE_COLUMNS:
            if not run.get("provenance", {}).get(c):
                errors.append(f"{RUN_FILE}: provenance.{c} empty")
        for name, part in run.get("parts", {}).items():
            if part.get("status") not in ("ok", "skipped", "error", "timeout", "partial"):
                errors.append(f"{RUN_FILE}: part {name} status={part.get('status')!r}")
    for name in FILES:
        if (out / name).exists():
            errors += validate_csv(out / name)
    return errors
