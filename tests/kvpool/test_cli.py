"""`kvpool` CLI: one-line errors naming the bad argument, status from a status file, probe."""

from __future__ import annotations

import json

import pytest

from vllm_kvpool.cli import main
from vllm_kvpool.metrics import (
    DeviceCounters,
    DeviceUsage,
    LookupCounters,
    PoolStatus,
    TransferCounters,
)


def test_bad_config_is_one_line_naming_the_field(capsys):
    assert main(["validate", "--config", '{"devices": [{"host": {"capacity": "1GiB", "numa": 1}}]}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "devices[0].host.numa" in err[0]


def test_unknown_subcommand_exits_nonzero():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_status_prints_table_and_plot(tmp_path, capsys):
    status = PoolStatus(
        usage=[DeviceUsage("host0", "host", 3, 8, 1 << 20, 6.0, False),
               DeviceUsage("ssd0", "ssd", 5, 16, 1 << 20, 2.0, False)],
        lookups=LookupCounters(query_tokens=1000, hit_tokens=640),
        transfers=TransferCounters({"ssd0": DeviceCounters(bytes_read=5 << 20, read_seconds=0.01)},
                                   [0.02]),
        placement="bandwidth", chunk_tokens=256)  # fmt: skip
    path = tmp_path / "status.json"
    status.write(path)
    assert main(["status", "--file", str(path), "--plot", str(tmp_path / "usage.png")]) == 0
    out = capsys.readouterr().out
    assert "ssd0" in out and "64.0%" in out
    assert (tmp_path / "usage.png").stat().st_size > 1000
    assert main(["status", "--file", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hit_rate"] == pytest.approx(0.64)


def test_probe_measures_a_file_device(tmp_path, capsys):
    pytest.importorskip("vllm_kvpool._kvio")
    cfg = {"devices": [{"host": {"capacity": "64MiB"}},
                       {"ssd": {"path": str(tmp_path / "d.bin"), "capacity": "64MiB"}}],
           "probe": {"seconds": 0.2, "size": "16MiB"}}  # fmt: skip
    assert main(["probe", "--config", json.dumps(cfg), "--seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "sum_gbps=" in out and float(out.split("sum_gbps=")[1]) > 0
