"""Media are registered by name (issue #26 item 3): a medium defined here, in the test only,
is parsed from a config, probed, opened and serves a pool's saves and fetches byte for byte."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from vllm_kvpool.config import PoolConfigError, int_field, load_pool_config
from vllm_kvpool.media import Medium, MediumSettings, media, register_medium, unregister_medium


@dataclass(frozen=True)
class ScratchSettings(MediumSettings):
    poison: int = 0xA5  # the byte every slot holds until a chunk is saved there

    @classmethod
    def parse(cls, body: Mapping[str, Any], where: str) -> ScratchSettings:
        poison = int_field(body, "poison", 0xA5, where)
        if poison > 255:
            raise PoolConfigError(f"{where}.poison", f"expected a byte value, got {poison}")
        return cls(poison)


class ScratchMedium(Medium):
    """Host memory filled with a poison byte when opened."""

    name = "scratch"
    settings = ScratchSettings

    def __init__(self) -> None:
        self.probed: list[str] = []

    def open(self, cfg, config, geometry, rank_suffix):
        from vllm_kvpool.handlers import HostMemoryHandler

        handler = HostMemoryHandler(cfg, geometry.slot_bytes, geometry.num_slots(cfg))
        handler.view(0, handler.pool.capacity).fill_(cfg.settings.poison)
        return handler

    def probe(self, cfg, config, geometry):
        self.probed.append(cfg.name)
        return 3.0


@pytest.fixture
def scratch() -> Iterator[ScratchMedium]:
    medium = ScratchMedium()
    register_medium(medium)
    yield medium
    unregister_medium(medium.name)


def test_config_parses_and_round_trips_a_registered_medium(scratch, tmp_path):
    raw = {"devices": [{"host": {"capacity": "1MiB"}},
                       {"scratch": {"capacity": "1MiB", "poison": 7}},
                       {"scratch": {"capacity": "2MiB", "numa_node": 0}}]}  # fmt: skip
    cfg = load_pool_config(raw)
    assert [(d.kind, d.name) for d in cfg.devices] == [
        ("host", "host0"), ("scratch", "scratch0"), ("scratch", "scratch1")]
    assert [d.settings for d in cfg.devices[1:]] == [ScratchSettings(7), ScratchSettings(0xA5)]
    assert load_pool_config(cfg.to_dict()) == cfg
    with pytest.raises(PoolConfigError) as err:
        load_pool_config({"devices": [{"scratch": {"capacity": "1MiB", "poison": 256}}]})
    assert err.value.field == "devices[0].scratch.poison"
    with pytest.raises(PoolConfigError) as err:
        load_pool_config({"devices": [{"scratch": {"capacity": "1MiB", "path": "/x"}}]})
    assert err.value.field == "devices[0].scratch.path"  # the ssd's fields are not scratch's
    with pytest.raises(ValueError, match="already registered"):
        register_medium(ScratchMedium())


def test_a_medium_cannot_redefine_the_common_fields():
    @dataclass(frozen=True)
    class Sized(MediumSettings):
        capacity: int = 0

    class Odd(ScratchMedium):
        name = "odd"
        settings = Sized

    with pytest.raises(ValueError, match="redefines the common fields capacity"):
        register_medium(Odd())
    assert "odd" not in media()


def test_unknown_medium_names_the_field_and_the_media():
    assert "scratch" not in media()  # the fixture above unregistered it
    with pytest.raises(PoolConfigError) as err:
        load_pool_config({"devices": [{"host": {"capacity": "1MiB"}},
                                      {"scratch": {"capacity": "1MiB"}}]})  # fmt: skip
    assert err.value.field == "devices[1]"
    assert "unknown medium 'scratch'" in str(err.value) and "host, ssd" in str(err.value)


def test_local_pool_saves_and_fetches_through_a_registered_medium(scratch):
    pytest.importorskip("vllm_kvpool._kvio")
    from vllm_kvpool.local import LocalPool

    blocks = 32
    kv = {f"l{i}": torch.randn(blocks, 2, 16, 32, generator=torch.Generator().manual_seed(i))
          for i in range(2)}  # fmt: skip
    want = {k: t.clone() for k, t in kv.items()}
    config = {"chunk_tokens": 64, "copy_threads": 1,
              "devices": [{"scratch": {"capacity": "1MiB", "poison": 7}}]}  # fmt: skip
    hashes = [f"b{i}".encode() for i in range(blocks)]
    with LocalPool(config, kv, blocks, block_size=16) as pool:
        assert scratch.probed == ["scratch0"] and pool.pool.weights.gbps == [3.0]
        (handler,) = pool.handlers
        assert bool((handler.view(0, handler.pool.capacity) == 7).all())  # opened by the medium
        assert pool.save(hashes, list(range(blocks))) == 8
        for t in kv.values():
            t.zero_()
        result = pool.fetch(hashes, list(range(blocks)))
        assert result.ok and result.blocks == blocks
        assert pool.status().transfers.devices["scratch0"].bytes_read > 0
    for k in kv:
        assert torch.equal(kv[k], want[k])
