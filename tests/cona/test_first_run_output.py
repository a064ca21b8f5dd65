"""A first run shows the product (issue 47): megatron-core's Transformer Engine / Apex warnings
become one note, a plan without a noise scale says what it ranks by (no "nan"), and on CPU the
RNG tracker's warning (on every fork there) is said once, with why."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")


def test_cona_plan_folds_the_te_apex_warnings_and_names_its_ranking(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-m", "megatron_cona.cli", "plan", "--world", "8",
                          "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads",
                          "8", "--seq-length", "512", "--top", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Transformer Engine and Apex are not installed") == 1, out.stderr
    assert "cona: note:" in out.stderr and "warnings.warn(" not in out.stderr
    assert "nan" not in out.stdout and "ranked by throughput" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "megatron_cona.cli", "plan", "--world", "8",
                          "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads",
                          "8", "--seq-length", "512", "--top", "2", "--noise-scale", "300"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0 and "goodput with noise scale 300" in out.stdout, out.stderr


def test_the_cpu_rng_warning_is_said_once_with_why(caplog):
    from megatron_cpu.cuda_redirect import RNG_WARNING, _RngWarningOnce

    log = logging.getLogger("test_first_run_output.rng")
    filt = _RngWarningOnce()
    log.addFilter(filt)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            for _ in range(5):
                log.warning(RNG_WARNING)
            log.warning("another warning")
    finally:
        log.removeFilter(filt)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and messages[1] == "another warning"
    assert messages[0].startswith(RNG_WARNING) and "expected on CPU" in messages[0]
