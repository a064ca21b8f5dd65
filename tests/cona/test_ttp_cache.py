"""Curve cache keys hash the provenance: the code that shapes training, engines, seed,
schedule, LR. A code change (or any of those) misses the cache; a hit reads the same curve."""

from __future__ import annotations

import shutil

import pytest

from megatron_cona.ttp.curves import (
    CODE_FILES,
    ROOT,
    Curve,
    CurveCache,
    CurveError,
    cache_key,
    code_hash,
    provenance,
)
from predictors.spec import TransformerSpec

SPEC = TransformerSpec("gpt", 2, 64, 4, 64, 257)


def _copy_tree(dst):
    for pattern in CODE_FILES:
        for path in ROOT.glob(pattern):
            target = dst / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


def _prov(code="c0", seed=1, lr=1e-3, schedule=None):
    return provenance(code=code, engines={"torch": "x"}, model=SPEC, seed=seed,
                      schedule=schedule or {"warmup": 256}, batch=16, lr=lr, ranks=1)


def test_a_code_change_invalidates_the_cache_key(tmp_path):
    _copy_tree(tmp_path)
    before = code_hash(tmp_path)
    assert code_hash(tmp_path) == before  # deterministic
    step = tmp_path / "megatron_cona/runtime/step.py"
    step.write_text(step.read_text() + "\n# a change\n")
    after = code_hash(tmp_path)
    assert after != before
    assert cache_key(_prov(code=before)) != cache_key(_prov(code=after))
    (tmp_path / "megatron_cona/data.py").unlink()
    with pytest.raises(CurveError, match="data.py"):
        code_hash(tmp_path)


def test_seed_schedule_and_lr_are_in_the_key():
    base = cache_key(_prov())
    assert cache_key(_prov()) == base
    assert cache_key(_prov(seed=2)) != base
    assert cache_key(_prov(lr=2e-3)) != base
    assert cache_key(_prov(schedule={"warmup": 128})) != base


def test_cache_round_trip_and_provenance_check(tmp_path):
    prov = _prov()
    curve = Curve(cache_key(prov), prov, [0, 64], [5.0, 4.0], [float("nan"), 4.5],
                  [[(1.0, 8, 0.5, 16), (1.1, 8, 0.6, 16)]], 1.5)
    cache = CurveCache(tmp_path)
    assert cache.get(prov) is None
    cache.put(curve)
    got = cache.get(prov)
    assert got.val_loss == [5.0, 4.0] and got.same_numbers(curve)
    assert cache.get(_prov(seed=9)) is None
    other = Curve(curve.key, prov, [0, 64], [5.0, 4.0 + 1e-12], curve.train_loss, curve.stats)
    assert not other.same_numbers(curve)  # bit-exact, not approximate
    # a file whose provenance does not match its key is refused, not silently used
    path = cache.path(curve.key)
    path.write_text(path.read_text().replace('"seed": 1', '"seed": 3'))
    with pytest.raises(CurveError, match="provenance differs"):
        cache.get(prov)
