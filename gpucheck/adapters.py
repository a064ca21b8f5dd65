"""The ONE place where the kit calls the product's APIs (predictors, CONA, kvpool).

The plugins' internals move; when an API changes, only this module follows it. Each function
returns plain values, so the parts stay independent of the product's classes.
"""

from __future__ import annotations

from typing import Any

# --------------------------------------------------------------------------- predictors: devices


def detect_device() -> Any | None:
    """The predictors' ``Device`` detected through NVML (None without a GPU/NVML)."""
    from predictors.devices import nvml_device

    return nvml_device()


def table_device(name: str, memory_bytes: float) -> tuple[str | None, Any | None]:
    """(key, Device) of the device-table entry the detection maps ``name`` to."""
    from predictors.devices import DEVICES, match_gpu_name

    dev = match_gpu_name(name, memory_bytes)
    if dev is None:
        return None, None
    return dev.name, DEVICES[dev.name]


def time_device(device: str) -> str:
    """The device name to ask the time predictor about for this machine: the table entry the
    NVML detection maps the GPU to, or ``cpu`` (this CPU, calibrated)."""
    if device == "cuda":
        dev = detect_device()
        if dev is not None:
            return dev.name
    return "cpu"


# --------------------------------------------------------------------------- time predictor


def transformer_spec(family: str, layers: int, hidden: int, heads: int, seq: int,
                     vocab: int) -> Any:
    from predictors.spec import TransformerSpec

    return TransformerSpec(family, layers, hidden, heads, seq, vocab,
                           swiglu=family == "llama", tied_embeddings=family != "llama")


def build_time_model(spec: Any) -> Any:
    from predictors.time.zoo import build

    return build(spec)


def time_batch(spec: Any, micro_batch: int) -> tuple[list, Any]:
    """(positional inputs, target) of one micro-batch, as ``predict collect`` feeds them."""
    from predictors.time.zoo import make_batch

    b = make_batch(spec, micro_batch)
    return list(b.inputs), b.target


def spec_row(spec: Any) -> tuple[str, str]:
    from predictors.time.collect import spec_to_row

    return spec_to_row(spec)


def predict_time(spec: Any, micro_batch: int, precision: str, device: str) -> dict:
    """Seconds per iteration predicted for one GPU (dp1tp1pp1)."""
    from predictors.spec import ParallelStrategy
    from predictors.time.predictor import predict

    res = predict(spec, ParallelStrategy(1, 1, 1, micro_batch, micro_batch), precision, device)
    return {"seconds": res.seconds, "analytical_s": res.analytical_seconds,
            "device": res.device, "calibrated": res.calibrated}


def megatron_runtime_spec(family: str, layers: int, hidden: int, heads: int, seq: int,
                          vocab: int) -> Any:
    """The text tower as CONA's runtime builds it in Megatron-Core: the local layer spec's
    unfused core attention (``DotProductAttention``: scores, fused softmax, context)."""
    from dataclasses import replace

    return replace(transformer_spec(family, layers, hidden, heads, seq, vocab),
                   attention="unfused")


def predict_megatron_time(spec: Any, strategy: str, precision: str, device: str) -> dict:
    """Seconds per iteration predicted for a Megatron-Core run of ``spec`` (framework
    ``megatron``, Megatron's default options)."""
    from predictors.spec import ParallelStrategy, TrainingOptions
    from predictors.time.predictor import predict

    res = predict(spec, ParallelStrategy.parse(strategy), precision, device,
                  options=TrainingOptions(framework="megatron"))  # fmt: skip
    return {"seconds": res.seconds, "analytical_s": res.analytical_seconds,
            "device": res.device, "calibrated": res.calibrated}


def megatron_step_columns() -> tuple[str, ...]:
    """Columns of the predictors' file of timed Megatron-Core steps."""
    from predictors.datasets.fleet import MEGATRON_STEP_COLUMNS

    return MEGATRON_STEP_COLUMNS


def megatron_steps_file(gpu_slug: str) -> str:
    from predictors.datasets.fleet import megatron_steps_file

    return megatron_steps_file(gpu_slug)


def write_device_profile(measurements_csv: Any, profile: dict) -> None:
    """The device a time-measurement CSV was taken on, where ``predict``'s loaders look."""
    import json

    from predictors.time.collect import device_profile_path

    device_profile_path(measurements_csv).write_text(json.dumps(profile, indent=2))


def train_time_family_model(measurements_csv: Any, models_dir: Any) -> str:
    """Train the time correction of the device family a measurement CSV was taken on (its
    ``.device.json``), labelled with the rows' provenance; returns the saved model's path."""
    import csv
    import json
    from pathlib import Path

    from predictors.time.collect import device_profile_path
    from predictors.time.train import train_measurement_model

    path = Path(measurements_csv)
    family = json.loads(device_profile_path(path).read_text())["family"]
    model = train_measurement_model(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    prov = sorted({f"{r['gpu']} driver {r['driver']} CUDA {r['cuda']} torch {r['torch']} "
                   f"{r['date']} commit {r['git_commit']}" for r in rows})
    model.family = family
    model.meta["training_data"] = (f"{path.name} ({len(rows)} GPU measurements, gpu_check; "
                                   + "; ".join(prov) + ")")
    return str(model.save(models_dir, f"time_{family}"))


def train_memory_model(ground_truth_csv: Any) -> str:
    """Retrain the shipped memory residual model on the (merged) ground truth."""
    from predictors.memory.train import train_and_save

    return train_and_save(ground_truth_csv).trained_on


# --------------------------------------------------------------------------- memory predictor


def memory_presets() -> dict[str, Any]:
    from predictors.memory.presets import PRESETS

    return PRESETS


def memory_scaled(base: str, width: float, depth: int, vocab: int, image_res: int | None,
                  seq: int | None = None) -> Any:
    from predictors.memory.presets import PRESETS, scaled

    spec = scaled(PRESETS[base], width, depth, vocab=vocab).with_seq(seq)
    return spec.at_resolution(image_res) if image_res and spec.vision is not None else spec


def memory_step(batch: int, precision: str, checkpointing: str = "none") -> Any:
    """One GPU's step in the one vocabulary: the micro-batch, recompute and precision."""
    from predictors.memory.config import Step

    return Step.data_parallel(batch, precision, recompute=checkpointing)


def build_memory_model(spec: Any, cfg: Any) -> Any:
    """The model the memory predictor describes, real (not emulated), checkpointing applied."""
    from predictors.memory.simulate import prepare_model

    return prepare_model(spec, cfg, emulate=False)


def memory_inputs(spec: Any, model: Any, cfg: Any) -> dict:
    from predictors.memory.build import make_inputs

    return make_inputs(spec, model, cfg.batch, spec.seq_length or 0, spec.images_per_sample)


def memory_row_fields(spec: Any, cfg: Any) -> dict:
    """key/spec/config columns exactly as ``predict collect-memory`` writes them."""
    import json

    from predictors.memory.collect import row_config, row_key, spec_to_json

    return {"key": row_key(spec, cfg), "spec": spec_to_json(spec),
            "config": json.dumps(row_config(spec, cfg))}


def predict_memory(spec: Any, cfg: Any, capacity_gib: float) -> dict:
    from predictors.memory.api import predict_peak_memory

    p = predict_peak_memory(spec, cfg.strategy, cfg.options, cfg.precision, capacity_gib)
    return {"peak_reserved": p.peak_reserved, "trained_on": p.trained_on}


def predict_memory_traced(spec: Any, cfg: Any, optimizer: str, device: str = "h200") -> dict:
    """The memory predictor's traced path for a preset spec (``predict memory --trace``): the
    real module on fake tensors with the chosen AdamW implementation, device-level output."""
    from dataclasses import replace

    from predictors.memory.module import predict_spec_memory

    # the kit measures this project's own step (plain PyTorch, the chosen AdamW), whatever
    # framework the step's options name for the time predictor
    options = replace(cfg.options, framework="pytorch")
    p = predict_spec_memory(spec, cfg.strategy, options, cfg.precision, device,
                            optimizer=f"adamw:{optimizer}")
    return {"peak_reserved": p.max_memory_reserved, "peak_allocated": p.max_memory_allocated,
            "device_used": p.device_used}


def predict_memory_module(model: Any, inputs: list, kwargs: dict, target: Any, precision: str,
                          optimizer: str, device: str = "h200") -> dict:
    """The memory predictor's ``nn.Module`` API (any model: here the MLP and the CNN) for one
    training step with AdamW (``optimizer``: fused | foreach) on ``device``."""
    from predictors.memory.module import predict_module_memory

    p = predict_module_memory(model, inputs, target, kwargs=kwargs or None,
                              optimizer=f"adamw:{optimizer}", precision=precision, device=device)
    return {"peak_reserved": p.max_memory_reserved, "peak_allocated": p.max_memory_allocated,
            "device_used": p.device_used}


# --------------------------------------------------------------------------- CONA runtime


def cona_train_config(spec: Any, precision: str) -> Any:
    from megatron_cona.runtime import TrainConfig

    return TrainConfig(spec, precision=precision, lr=1e-3, lr_warmup_samples=0)


def cona_step_precision(on_gpu: bool) -> tuple[str, str]:
    """(precision, why) of the kit's timed Megatron-Core steps: fp8 where Transformer Engine is
    importable and CONA's runtime builds fp8, else bf16 (fp32 on a CPU dry run)."""
    from megatron_cona.runtime.config import SUPPORTED_PRECISIONS

    if not on_gpu:
        return "fp32", "cpu dry run"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "bf16-mixed", "fp8: Transformer Engine is not importable here"
    if "fp8" not in SUPPORTED_PRECISIONS:
        return "bf16-mixed", ("fp8: Transformer Engine is here, but CONA's runtime builds "
                              "Megatron-Core's local layer spec (no fp8)")
    return "fp8", "Transformer Engine"


def cona_token_dataset(vocab: int, seq: int) -> Any:
    """A repeating token pattern: a GPT learns it quickly, so the loss must fall."""
    import torch

    from megatron_cona.runtime import TokenDataset

    pattern = torch.randint(0, vocab, (97,), generator=torch.Generator().manual_seed(0))
    return TokenDataset(pattern.repeat(400), seq)


def cona_build(cfg: Any, strategy: str) -> Any:
    from megatron_cona.runtime import build_state
    from predictors.spec import ParallelStrategy

    return build_state(cfg, ParallelStrategy.parse(strategy))


def cona_train_step(state: Any, data: Any) -> dict:
    from megatron_cona.runtime import train_step

    r = train_step(state, data)
    return {"loss": float(r.loss), "iteration": state.iteration,
            "consumed_samples": state.consumed_samples, "strategy": state.strategy.name}


def cona_evaluate(state: Any, data: Any, num_samples: int) -> float:
    """Forward-only loss of the first ``num_samples`` samples (no update; collective)."""
    from megatron_cona.runtime import evaluate

    return float(evaluate(state, data, 0, num_samples))


def cona_switch(state: Any, strategy: str) -> tuple[Any, dict]:
    """CONA's transactional strategy switch (in a 1-rank world only the batch can change)."""
    from megatron_cona.runtime import switch_strategy
    from predictors.spec import ParallelStrategy

    res = switch_strategy(state, ParallelStrategy.parse(strategy))
    return res.state, {"switched": res.switched, "moved_tensors": res.moved_tensors,
                       "error": res.error, "seconds": res.seconds}


def cona_state_tensors(state: Any) -> dict[str, Any]:
    """Every tensor a reshard carries (weights, fp32 main weights, Adam moments), by key."""
    from megatron_cona.reshard import layout, optimizer_state

    kinds, _, _ = optimizer_state.adam_kinds(state)
    return {f"{i}:{s.meta.key}": s.view
            for i, s in enumerate(layout.state_segments(state, kinds))}


def cona_reshard_same_layout(state: Any, bucket_bytes: int) -> tuple[Any, dict]:
    """The reshard path a 1-rank world has: build a fresh state of the same layout (no weight
    init), ``transfer_state`` everything into it through the process group in buckets, then
    drop the old one. Returns (new state, facts)."""
    from megatron_cona.reshard import transfer_state
    from megatron_cona.runtime import activate, build_state

    new = build_state(state.config, state.strategy, iteration=state.iteration,
                      consumed_samples=state.consumed_samples, initialize=False,
                      activate_now=False)
    try:
        stats = transfer_state(state, new, bucket_bytes=bucket_bytes)
    except Exception:
        new.destroy()
        raise
    state.destroy()
    activate(new)
    return new, {"bytes_total": stats.bytes_total, "bytes_sent": stats.bytes_sent,
                 "buckets": stats.num_buckets, "peak_buffer_bytes": stats.peak_buffer_bytes}


# --------------------------------------------------------------------------- kvpool engine


def kvpool_local(kv: dict, num_blocks: int, block_tokens: int, chunk_tokens: int,
                 device: dict, staging: str = "256MiB", verify: bool = True) -> Any:
    """A ``LocalPool`` over one pool device (``{"host": {...}}`` or ``{"ssd": {...}}``) for the
    KV tensors ``kv``: the connector's jobs and engine; ``verify``: host chunks hashed on every
    fetch too (``verify_checksums``; SSD reads are always verified)."""
    from vllm_kvpool.local import LocalPool

    config = {"chunk_tokens": chunk_tokens, "staging": staging, "verify_checksums": verify,
              "devices": [device]}  # fmt: skip
    return LocalPool(config, kv, num_blocks, block_tokens, bandwidths=[1.0], layout_id="gpucheck")
