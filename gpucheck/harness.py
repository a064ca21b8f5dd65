"""Run the kit's parts, each in its own process under its own time budget, into one folder.

A part that fails, hangs or leaves CUDA broken cannot stop the next one: the harness kills it
at its limit (its rows so far stay, flushed row by row), records why, and starts the next part
in a fresh process. At the end every file is validated against :mod:`gpucheck.schema` and
``run.json`` records provenance, each part's status, duration and summary, and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpucheck import carry as carry_mod
from gpucheck.common import ROOT, PartContext, collect_provenance, error_text
from gpucheck.schema import FILES, LOG_FILE, RUN_FILE, validate_run

RESULT_TAG = "GPUCHECK_RESULT "


@dataclass(frozen=True)
class PartSpec:
    name: str
    file: str
    gpu_budget_s: float  # share of the default 450 s GPU budget
    dry_budget_s: float
    title: str
    in_default_run: bool = True  # False: only when named (``--parts``), its own device command

    @property
    def module(self) -> str:
        return {"time": "timing"}.get(self.name, self.name)


PARTS = (
    PartSpec("device", "device.csv", 25, 60, "NVML detection into predictors' Device vs table"),
    PartSpec("kvio", "kvio.csv", 110, 60, "_kvio build + transfer engine GPU path vs memcpy"),
    PartSpec("memory", "memory.csv", 135, 150, "memory ground truth vs the memory predictor"),
    PartSpec("time", "time.csv", 105, 120, "time ground truth vs the time predictor"),
    PartSpec("megatron", "megatron.csv", 105, 150, "GPTModel through CONA's runtime, timed "
             "Megatron-Core steps"),
    # The five above fill one 600-s device command; the TTFT part is a second one (--parts ttft).
    PartSpec("ttft", "kvio.csv", 180, 60, "long-prefix TTFT: pool fetch + new suffix vs recompute",
             in_default_run=False),
)
GPU_BUDGET_S = 480.0  # the device tool allows 600 s a command; the kit aims at <= 8 min
GRACE_S = 15.0  # after its budget a part gets this long to finish its row before the kill


def _log(log, text: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {text}"
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def _run_part(ctx: PartContext, ctx_path: Path, env: dict, timeout: float, log) -> dict:
    """Start ``python -m gpucheck.part``; stream its output into the log; kill it at timeout."""
    cmd = [sys.executable, "-u", "-m", "gpucheck.part", str(ctx_path)]
    start = time.monotonic()
    cpu0 = _children_cpu()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    result: dict | None = None
    timed_out = False

    def kill():
        nonlocal timed_out
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    import threading

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                continue
            log.write(f"  [{ctx.name}] {line}")
            log.flush()
        rc = proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - start
    if result is None:
        why = (f"killed at its {timeout:.0f} s limit" if timed_out
               else f"exited with code {rc} before reporting (see {LOG_FILE})")
        result = {"status": "timeout" if timed_out else "error", "error": why, "rows": None}
    result["seconds"] = round(seconds, 2)
    result["cpu_seconds"] = round(_children_cpu() - cpu0, 2)
    return result


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _budgets(parts: list[PartSpec], total: float, dry_run: bool) -> dict[str, float]:
    shares = {p.name: (p.dry_budget_s if dry_run else p.gpu_budget_s) for p in parts}
    scale = min(1.0, total / max(1e-9, sum(shares.values())))
    return {k: v * scale for k, v in shares.items()}


def _prepare_carry(carry: Path, scratch: Path, log) -> tuple[dict, str | None, dict]:
    """Install carried wheels and unpack carried .debs; returns (env, liburing prefix, info)."""
    env: dict[str, str] = {}
    info: dict = {"carry": str(carry)}
    try:
        site = scratch / "site"
        info["wheels"] = carry_mod.install_wheels(carry, site)
        env["PYTHONPATH"] = str(site)
        _log(log, f"carry: installed {len(info['wheels'])} wheels into {site}")
    except Exception as exc:  # noqa: BLE001 - recorded; the parts report what is missing
        info["wheels_error"] = error_text(exc)
        _log(log, f"carry: wheels not installed: {info['wheels_error']}")
    prefix = scratch / "prefix"
    try:
        env.update(carry_mod.unpack_debs(carry, prefix))
        info["liburing"] = carry_mod.liburing_version(prefix)
        _log(log, f"carry: .debs unpacked into {prefix} (liburing {info['liburing']})")
        return env, str(prefix), info
    except Exception as exc:  # noqa: BLE001
        info["debs_error"] = error_text(exc)
        _log(log, f"carry: .debs not unpacked: {info['debs_error']}")
        return env, None, info


def run(out: Path, *, dry_run: bool, budget_s: float | None = None,
        parts: list[str] | None = None, carry: Path | None = None,
        workdir: Path | None = None, options: dict | None = None) -> dict:
    """Run the selected parts into ``out``; returns the content of ``run.json``."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    for name in (RUN_FILE, LOG_FILE, *FILES):  # a rerun replaces, never appends to, a run
        (out / name).unlink(missing_ok=True)
    selected = [p for p in PARTS if (p.in_default_run if parts is None else p.name in parts)]
    unknown = sorted(set(parts or ()) - {p.name for p in PARTS})
    if unknown:
        raise SystemExit(f"gpu_check: unknown part(s) {unknown}; choose from "
                         f"{[p.name for p in PARTS]}")
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    total = budget_s or (GPU_BUDGET_S if not dry_run else sum(p.dry_budget_s for p in selected))
    budgets = _budgets(selected, total, dry_run)
    started = time.monotonic()
    if workdir is None and not dry_run:  # the machine's disk, not a tmpfs /tmp (O_DIRECT)
        workdir = ROOT / "out"
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpucheck-", dir=workdir))
    with open(out / LOG_FILE, "a") as log:
        prov = collect_provenance(dry_run)
        _log(log, f"gpu_check: {'DRY RUN (cpu, tiny sizes)' if dry_run else 'GPU run'} on "
                  f"{prov.gpu}; driver {prov.driver}, CUDA {prov.cuda}, torch {prov.torch}, "
                  f"python {prov.python}, commit {prov.git_commit}; budget {total:.0f} s")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        carry_info: dict = {"carry": None}
        prefix = None
        site = None
        if carry is not None:
            extra, prefix, carry_info = _prepare_carry(carry, scratch, log)
            site = extra.pop("PYTHONPATH", None)
            env.update(extra)
        # carried packages first, then the repository, then whatever the caller had
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, str(ROOT),
                                                          os.environ.get("PYTHONPATH")]))
        results: dict[str, dict] = {}
        for spec in selected:
            ctx = PartContext(name=spec.name, out=str(out), dry_run=dry_run, device=device,
                              budget_s=budgets[spec.name], provenance=prov.to_dict(),
                              workdir=str(scratch / spec.name), kvio_prefix=prefix,
                              options=options or {})
            Path(ctx.workdir).mkdir(parents=True, exist_ok=True)
            ctx_path = scratch / f"{spec.name}.ctx.json"
            ctx.save(ctx_path)
            _log(log, f"part {spec.name}: {spec.title} (budget {ctx.budget_s:.0f} s)")
            res = _run_part(ctx, ctx_path, env, ctx.budget_s + GRACE_S, log)
            results[spec.name] = res
            _log(log, f"part {spec.name}: {res['status']} in {res['seconds']:.1f} s "
                      f"({res['cpu_seconds']:.1f} s cpu), "
                      f"{res.get('rows')} rows" + (f"; {res['error']}" if res.get("error")
                                                   else ""))
        run_info = {
            "dry_run": dry_run, "device": device, "provenance": prov.to_dict(),
            "budget_s": total, "seconds": round(time.monotonic() - started, 2),
            "carry": carry_info, "parts": results,
            "files": sorted(p.name for p in out.iterdir() if p.is_file()) + [RUN_FILE],
        }
        (out / RUN_FILE).write_text(json.dumps(run_info, indent=2, default=str))
        errors = validate_run(out)
        run_info["schema_errors"] = errors
        (out / RUN_FILE).write_text(json.dumps(run_info, indent=2, default=str))
        _log(log, "schema: " + ("all files valid" if not errors else f"{len(errors)} errors: "
                                + "; ".join(errors[:5])))
        for name, res in results.items():  # the device tool returns the output's tail
            _log(log, f"summary {name}: " + json.dumps(res.get("summary") or res.get("error"),
                                                       default=str)[:600])
        _log(log, f"gpu_check: done in {run_info['seconds']:.0f} s: " + ", ".join(
            f"{k} {v['status']}" for k, v in results.items()))
    shutil.rmtree(scratch, ignore_errors=True)  # build tree, carried site, the I/O file
    return run_info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out/gpu-check"),
                   help="result folder (default: $OUT, else out/gpu-check)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the same harness on CPU at tiny sizes (CUDA parts: skipped: no GPU)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all parts (default {GPU_BUDGET_S:.0f} on a GPU)")
    p.add_argument("--parts", default=None,
                   help=f"comma list of {', '.join(p.name for p in PARTS)} (default: all)")
    p.add_argument("--carry", type=Path, default=None,
                   help="folder made by scripts/gpu_carry.sh (default: .gpu-carry on a GPU run)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="scratch folder on the machine's disk (default: out/ on a GPU run, the "
                        "system temp dir on a dry run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible to torch; use --dry-run on a CPU machine",
              file=sys.stderr)
        return 2
    carry = args.carry
    if carry is None and not args.dry_run and (ROOT / ".gpu-carry").is_dir():
        carry = ROOT / ".gpu-carry"
    parts = [s.strip() for s in args.parts.split(",") if s.strip()] if args.parts else None
    info = run(args.out, dry_run=args.dry_run, budget_s=args.budget, parts=parts, carry=carry,
               workdir=args.workdir)
    bad = [k for k, v in info["parts"].items() if v["status"] not in ("ok", "skipped")]
    return 1 if bad or info["schema_errors"] else 0
