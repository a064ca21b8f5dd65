"""Pool config parsing: YAML file, inline JSON, dicts; malformed configs name the field."""

from __future__ import annotations

import json

import pytest

from vllm_kvpool.config import PoolConfigError, load_pool_config, parse_size, pool_config_from_extra

YAML = """
chunk_tokens: 256
placement: bandwidth
devices:
  - host: {numa_node: 0, capacity: 2GiB}
  - ssd: {path: {tmp}/ssd0.bin, capacity: 8GiB, backend: uring}
  - ssd: {path: {tmp}/ssd1.bin, capacity: 8GiB, backend: posix, name: slow}
probe: {seconds: 0.2, size: 16MiB}
"""


def test_yaml_file_and_inline_json_agree(tmp_path):
    path = tmp_path / "kvpool.yaml"
    path.write_text(YAML.replace("{tmp}", str(tmp_path)))
    cfg = load_pool_config(str(path))
    assert [d.name for d in cfg.devices] == ["host0", "ssd0", "slow"]
    assert [d.kind for d in cfg.devices] == ["host", "ssd", "ssd"]
    assert cfg.devices[0].capacity == 2 * 2**30
    assert [d.settings.backend for d in cfg.devices[1:]] == ["uring", "posix"]
    assert cfg.devices[2].settings.path == f"{tmp_path}/ssd1.bin"
    assert cfg.probe.size == 16 * 2**20 and cfg.placement == "bandwidth"
    again = load_pool_config(json.dumps(cfg.to_dict()))
    assert again == cfg
    assert pool_config_from_extra({"pool": str(path)}) == cfg
    assert pool_config_from_extra(cfg.to_dict()) == cfg


def test_sizes():
    assert parse_size("1.5GiB", "x") == int(1.5 * 2**30)
    assert parse_size("512MB", "x") == 512 * 10**6
    assert parse_size(4096, "x") == 4096


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({}, "devices"),
        ({"devices": []}, "devices"),
        ({"devices": [{"gpu": {}}]}, "devices[0]"),
        ({"devices": [{"host": {}}]}, "devices[0].host.capacity"),
        ({"devices": [{"host": {"capacity": "12 parsecs"}}]}, "devices[0].host.capacity"),
        ({"devices": [{"host": {"capacity": -1}}]}, "devices[0].host.capacity"),
        # validated, then `kvpool daemon` served it until an engine opened the pool
        ({"devices": [{"host": {"capacity": "99999999TiB"}}]}, "devices[0].host.capacity"),
        ({"devices": [{"host": {"capacity": 2**64}}]}, "devices[0].host.capacity"),
        # validated; a pool could open only to hold no chunk (every chunk's slot is >= 4 KiB)
        ({"devices": [{"host": {"capacity": 1}}]}, "devices[0].host.capacity"),
        ({"devices": [{"host": {"capacity": "1GiB"}}, {"ssd": {"capacity": "4095B",
                                                                "path": "/tmp/x"}}]},
         "devices[1].ssd.capacity"),
        # validated: a thread count no machine has cores for (the engine would start them)
        ({"devices": [{"host": {"capacity": "1GiB"}}], "copy_threads": 100000}, "copy_threads"),
        ({"devices": [{"host": {"capacity": "1GiB", "numa": 0}}]}, "devices[0].host.numa"),
        ({"devices": [{"ssd": {"capacity": "1GiB"}}]}, "devices[0].ssd.path"),
        ({"devices": [{"ssd": {"capacity": "1GiB", "path": "/tmp/x", "backend": "aio"}}]},
         "devices[0].ssd.backend"),
        ({"devices": [{"ssd": {"capacity": "1GiB", "path": "/nonexistent/dir/x"}}]},
         "devices[0].ssd.path"),
        # validated, then `kvpool probe` raised the engine's ValueError
        ({"devices": [{"ssd": {"capacity": "1GiB", "path": "/"}}]}, "devices[0].ssd.path"),
        ({"devices": [{"ssd": {"capacity": "1GiB", "path": "nvme", "backend": "spdk"}}]},
         "devices[0].ssd.spdk_trid"),
        ({"devices": [{"ssd": {"capacity": "1GiB", "path": "/tmp/x"}},
                      {"ssd": {"capacity": "1GiB", "path": "/tmp/x"}}]}, "devices[1].ssd.path"),
        ({"devices": [{"host": {"capacity": "1GiB", "name": "a"}},
                      {"host": {"capacity": "1GiB", "name": "a"}}]}, "devices[1].host.name"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "placement": "random"}, "placement"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": 0}, "chunk_tokens"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "probe": {"seconds": "fast"}},
         "probe.seconds"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "chunk": 5}, "chunk"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "save_decode": "yes"}, "save_decode"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "save_wait_seconds": -1},
         "save_wait_seconds"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "save_wait_seconds": "0.5"},
         "save_wait_seconds"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "probe": {"enabled": 1}}, "probe.enabled"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "migration": {"margin": -1}},
         "migration.margin"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "migration": {"bandwidth": 0}},
         "migration.bandwidth"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "migration": {"rate": 1}},
         "migration.rate"),
        ({"devices": [{"host": {"capacity": "1GiB"}}], "migration": {"enabled": True},
          "service": True}, "migration.enabled"),
    ],
)  # fmt: skip
def test_malformed_configs_name_the_field(raw, field):
    with pytest.raises(PoolConfigError) as err:
        load_pool_config(raw)
    assert err.value.field == field
    assert str(err.value).startswith(f"kvpool config: {field}: ")


def test_the_smallest_capacity_and_the_most_copy_threads_are_taken():
    cfg = load_pool_config({"devices": [{"host": {"capacity": "4KiB"}}], "copy_threads": 1024})
    assert cfg.devices[0].capacity == 4096 and cfg.copy_threads == 1024


def test_a_capacity_too_small_for_the_models_chunk_names_both_sizes():
    """Past the config's floor (one 4 KiB slot) a chunk is as large as the model makes it: the
    layout, built once the model is known, names the device and both sizes."""
    from vllm_kvpool import layout as layouts

    cfg = load_pool_config({"devices": [{"host": {"capacity": "1GiB"}},
                                        {"host": {"capacity": "64KiB"}}], "chunk_tokens": 64})
    # 4 layers x K and V x 2 heads x 64 x 2 bytes = 2 KiB a token: 128 KiB a chunk
    geo = layouts.ModelGeometry("toy", 4, 2, 64, 2, None, 0, "")
    with pytest.raises(PoolConfigError) as err:
        layouts.from_model(cfg, geo, 16)
    assert err.value.field == "devices[1].host.capacity"
    assert "65536 bytes holds no chunk of 131072 bytes (64 tokens)" in str(err.value)


def test_missing_file_and_bad_text():
    with pytest.raises(PoolConfigError, match="kv_connector_extra_config.pool"):
        pool_config_from_extra({"pool": "/nonexistent/kvpool.yaml"})
    with pytest.raises(PoolConfigError, match="kv_connector_extra_config.pool: missing"):
        pool_config_from_extra({})
    with pytest.raises(PoolConfigError, match="pool"):
        load_pool_config("{not json: [")


def test_chunk_tokens_must_be_block_multiple():
    cfg = load_pool_config({"devices": [{"host": {"capacity": "1GiB"}}], "chunk_tokens": 48})
    with pytest.raises(PoolConfigError, match="chunk_tokens: 48 is not a multiple"):
        cfg.check_block_size(32)
    assert load_pool_config({"devices": [{"host": {"capacity": "1GiB"}}],
                             "chunk_tokens": 64}).check_block_size(32) == 2  # fmt: skip


def test_save_wait_may_be_zero_where_other_durations_may_not():
    """``save_wait_seconds: 0`` turns the wait off; a probe of 0 seconds is still an error."""
    host = {"devices": [{"host": {"capacity": "1GiB"}}]}
    assert load_pool_config({**host, "save_wait_seconds": 0}).save_wait_seconds == 0.0
    assert load_pool_config(host).save_wait_seconds == 0.5
    with pytest.raises(PoolConfigError) as err:
        load_pool_config({**host, "probe": {"seconds": 0}})
    assert err.value.field == "probe.seconds"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"devices": [{"host": {"capacity": "1GiB"}}], "probe": {"seconds": NaN}}',
         "probe.seconds"),
        ('{"devices": [{"host": {"capacity": "1GiB", "bandwidth_gbps": Infinity}}]}',
         "devices[0].host.bandwidth_gbps"),
        ("devices: [{host: {capacity: 1GiB}}]\nsave_wait_seconds: .nan\n", "save_wait_seconds"),
        ("devices: [{host: {capacity: 1GiB}}]\ndevice_retry_seconds: .inf\n",
         "device_retry_seconds"),
        ("devices: [{host: {capacity: 1GiB}}]\nmigration: {margin: .nan}\n", "migration.margin"),
    ],
)  # fmt: skip
def test_nan_and_infinite_numbers_name_the_field(text, field):
    """JSON's NaN / Infinity and YAML's .nan / .inf parse as floats: each was taken as a setting
    (a NaN probe time, an infinite placement weight) until the number check asked for finite."""
    with pytest.raises(PoolConfigError) as err:
        load_pool_config(text)
    assert err.value.field == field and "finite" in str(err.value)


@pytest.mark.parametrize(
    ("content", "field", "says"),
    [
        (b"\xff\xfe devices", "pool ({path})", "not UTF-8"),
        (b"devices: [host: {capacity: 1GiB}\n", "pool ({path})", "neither valid JSON nor YAML"),
        (b"", "pool", "expected a mapping, got NoneType"),
        (b"just words\n", "pool", "expected a mapping, got str"),
    ],
)  # fmt: skip
def test_unreadable_config_files_are_one_line_naming_the_file(tmp_path, content, field, says):
    """A binary file raised UnicodeDecodeError, a YAML syntax error's message ran over six
    lines, and an empty or scalar file was blamed on a field named ''."""
    path = tmp_path / "kvpool.yaml"
    path.write_bytes(content)
    with pytest.raises(PoolConfigError) as err:
        load_pool_config(str(path))
    assert err.value.field == field.format(path=path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_directory_given_as_the_config_is_not_said_to_be_missing(tmp_path):
    with pytest.raises(PoolConfigError, match="is not a file"):
        load_pool_config(str(tmp_path))
