"""LoRA in the presets (``LoraSpec``) against PEFT on real small modules: the adapters' and the
rest's trainable parameter count is PEFT's own, the gradients a real backward leaves are the
factorization's, and Adam's states (torch's AdamW on what trains) are the phase walk's
optimizer bytes, with fp32 masters and states for bf16 weights as DeepSpeed keeps them."""

from __future__ import annotations

from dataclasses import replace

import peft
import pytest
import torch
from torch import nn

from predictors.memory.build import build_model, make_inputs
from predictors.memory.config import Step
from predictors.memory.factorize import factorize
from predictors.memory.overheads import HOPPER
from predictors.memory.phases import ADAM_STEP_BLOCK, walk_phases
from predictors.memory.presets import as_memory_model
from predictors.spec import (
    LoraSpec,
    ModelSpec,
    ModelSpecError,
    TransformerSpec,
    VisionTowerSpec,
)
from predictors.spec.model import LORA_TARGETS

# vocabulary past LLaVA's image token id (32000)
TEXT = TransformerSpec("llama", 2, 64, 4, 96, 32064, ffn_hidden_size=172, num_query_groups=2,
                       swiglu=True, tied_embeddings=False, attention="unfused")
VISION = VisionTowerSpec("clip", 2, 64, 4, 128, 14, 56, attention="unfused")
LLAVA = ModelSpec("tiny-llava", "llava", VISION, TEXT, frozen=("vision",), lora=LoraSpec(8))
QWEN = ModelSpec("tiny-qwen2", "llm", text=replace(TEXT, family="qwen2"),
                 lora=LoraSpec(4, targets=("q_proj", "v_proj"), dropout=0.0))


def llava_linear_names(model: nn.Module) -> set[str]:
    """LLaVA's ``find_all_linear_names`` (llava/train/train.py): every Linear outside the
    vision tower and the projector, by its last name, without the head."""
    names = {name.split(".")[-1] for name, m in model.named_modules()
             if isinstance(m, nn.Linear)
             and not any(k in name for k in ("vision_tower", "multi_modal_projector"))}
    return names - {"lm_head"}


def peft_model(spec: ModelSpec) -> nn.Module:
    """The spec's real module with PEFT's adapters; a multimodal one on the Linears LLaVA's
    script finds, which must be the spec's default targets. LLaVA adds the adapters before it
    builds the vision tower (``initialize_vision_modules`` runs after ``get_peft_model``), so
    its q/k/v-named Linears get none: here a regex keeps PEFT to the language model."""
    torch.manual_seed(0)
    model = build_model(spec, spec.attention, emulate=False)
    for p in model.parameters():  # the build skips initialisation: give the step finite values
        nn.init.normal_(p, std=0.02)
    targets = set(spec.lora.targets)
    if spec.multimodal:
        targets = llava_linear_names(model)
        assert targets == set(LORA_TARGETS)
    pattern = rf".*{'language_model' if spec.multimodal else ''}.*\.({'|'.join(sorted(targets))})"
    config = peft.LoraConfig(r=spec.lora.rank, lora_alpha=2 * spec.lora.rank,
                             lora_dropout=spec.lora.dropout, target_modules=pattern)
    model = peft.get_peft_model(model, config)
    if spec.multimodal:  # LLaVA's initialize_vision_modules: "in case it is frozen by LoRA"
        for p in model.base_model.model.model.multi_modal_projector.parameters():
            p.requires_grad = True
    return model


@pytest.mark.parametrize("spec", [LLAVA, QWEN], ids=["llava-r8-all-linear", "qwen2-r4-qv"])
def test_lora_trainable_parameters_gradients_and_adam_states_match_peft(spec):
    model = peft_model(spec)
    trainable_peft, _ = model.get_nb_trainable_parameters()
    fz = factorize(spec, Step.data_parallel(2, "fp32"))
    trained = [x for x in fz.layers if x.trainable]
    assert sum(x.params for x in trained) == trainable_peft
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert sum(x.params for x in fz.layers if x.tower == "lora") == adapters
    assert fz.num_trainable_tensors == sum(p.requires_grad for p in model.parameters())
    assert not any(x.trainable for x in fz.layers if x.tower == "llm")  # the base is frozen

    # a real step: gradients only for what trains; torch's AdamW creates its states for them
    inputs = make_inputs(spec, model.base_model.model, 2, spec.text.seq_length)
    model(**inputs).loss.backward()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    assert grads == sum(x.param_bytes for x in trained)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    opt.step()
    adam = sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in opt.state.values())
    est = walk_phases(spec, Step.data_parallel(2, "fp32"), HOPPER, fz)
    blocks = fz.num_trainable_tensors * ADAM_STEP_BLOCK  # the fused optimizer's step tensors
    assert len(opt.state) == fz.num_trainable_tensors
    assert est.components["optimizer_states"] - blocks == adam

    # bf16 weights (LLaVA casts the model before adding adapters): the frozen base keeps
    # 2 B/param and nothing else; what trains gets an fp32 master and fp32 Adam states
    mixed = Step.data_parallel(2, "bf16-mixed")
    fz16 = factorize(spec, mixed)
    est16 = walk_phases(spec, mixed, HOPPER, fz16)
    bf16 = model.to(torch.bfloat16)
    assert est16.components["parameters"] == sum(p.nbytes for p in bf16.parameters())
    masters = [p.detach().float().requires_grad_() for p in bf16.parameters() if p.requires_grad]
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt32 = torch.optim.AdamW(masters)
    opt32.step()
    states = sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in opt32.state.values())
    assert est16.components["optimizer_states"] - blocks == states + sum(
        m.nbytes for m in masters)


def test_lora_shrinks_what_a_7b_llava_keeps_for_the_optimizer():
    """At LLaVA's rank 128 a 7B LLaVA trains 5% of what full finetuning trains (adapters and
    projector), and keeps 12 B of fp32 master and Adam states per trained weight."""
    full = as_memory_model("llava-1.5-7b-like", frozen=("vision",))
    lora = as_memory_model(full, lora=LoraSpec(128))
    step = Step.data_parallel(1, "bf16-mixed")
    t_full = sum(x.params for x in factorize(full, step).layers if x.trainable)
    t_lora = sum(x.params for x in factorize(lora, step).layers if x.trainable)
    # per layer r x (4 x (4096 + 4096) + 3 x (4096 + 11008)): 10.0M adapter weights
    adapters = 32 * 128 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert t_lora == adapters + projector
    assert t_lora / t_full == pytest.approx(0.05, abs=0.001)
    opt = walk_phases(lora, step, HOPPER).components["optimizer_states"]
    assert opt == 12 * t_lora + (32 * 14 + 4) * ADAM_STEP_BLOCK


def test_bad_lora_is_named():
    with pytest.raises(ModelSpecError, match="rank=0"):
        LoraSpec(0)
    with pytest.raises(ModelSpecError, match="fc1"):
        LoraSpec(8, targets=("q_proj", "fc1"))
    with pytest.raises(ModelSpecError, match="dropout=1.0"):
        LoraSpec(8, dropout=1.0)
    with pytest.raises(ModelSpecError, match="text tower"):
        ModelSpec("vit", "vit", VISION, lora=LoraSpec(8))


def test_cli_lora_rank(capsys):
    """``--lora-rank`` prices the adapters (the JSON's optimizer states shrink to those of
    what trains) and is refused, named, with ``--trace`` (no adapters are built there)."""
    import json

    from predictors.memory.cli import main

    base = ["memory", "--model", "llava-1.5-7b-like", "--seq", "1024", "--precision",
            "bf16-mixed", "--freeze", "vision", "--json"]
    main(base)
    full = json.loads(capsys.readouterr().out)
    main([*base, "--lora-rank", "16"])
    lora = json.loads(capsys.readouterr().out)
    spec = as_memory_model("llava-1.5-7b-like", seq=1024, frozen=("vision",),
                           lora=LoraSpec(16))
    trained = sum(x.params for x in factorize(spec, Step.data_parallel(1, "bf16-mixed")).layers
                  if x.trainable)
    assert lora["analytical.optimizer_states"] == 12 * trained + (32 * 14 + 4) * ADAM_STEP_BLOCK
    assert lora["analytical.optimizer_states"] < full["analytical.optimizer_states"] / 10
    main([*base, "--lora-rank", "16", "--lora-bits", "4"])
    qlora = json.loads(capsys.readouterr().out)
    assert qlora["analytical.optimizer_states"] == lora["analytical.optimizer_states"]
    assert qlora["analytical.parameters"] < 0.4 * lora["analytical.parameters"]
    assert main([*base, "--lora-rank", "16", "--trace"]) == 1
    assert "--lora-rank" in capsys.readouterr().err


@pytest.mark.parametrize("precision,dropout", [("fp32", 0.05), ("bf16", 0.0),
                                               ("bf16-mixed", 0.05)])
def test_lora_layer_activations_equal_the_tracker(precision, dropout):
    """A PEFT-wrapped tiny LLaVA's decoder layers save what the factorization says (frozen
    base, adapters' dropout and A outputs, autocast copies), traced on fake tensors; the
    dropout's mask is bool in both (the tracer runs CUDA's fused dropout:
    ``tracker.CudaDropout``)."""
    from predictors.memory.decompose import saved_by_layer
    from predictors.memory.module import _fake_module
    from predictors.memory.simulate import Batch, loss_from_output, prepare_model, trace_step

    spec = replace(LLAVA.with_seq(64).with_attention("flash"),
                   lora=LoraSpec(8, dropout=dropout))
    cfg = Step.data_parallel(2, precision)
    pattern = rf".*language_model.*\.({'|'.join(LORA_TARGETS)})"
    with torch.device("meta"):
        model = prepare_model(replace(spec, lora=None, frozen=("vision", "llm")), cfg)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=dropout, target_modules=pattern))
    for p in model.base_model.model.model.multi_modal_projector.parameters():
        p.requires_grad = True

    def batch(m: nn.Module) -> Batch:
        kw = make_inputs(spec, m.base_model.model, cfg.batch, spec.text.seq_length)
        return Batch((), kw["labels"], kw)

    traced = saved_by_layer(trace_step(lambda: _fake_module(model), batch, precision,
                                       loss_fn=loss_from_output, steps=1).saved_by_module)
    fz = factorize(spec, cfg)
    layers = [x for x in fz.layers if x.name.startswith("llm.layers.")]
    assert all(x.saved == 0 for x in layers if x.tower == "lora")  # counted in their layer
    for x in layers:
        if x.tower == "llm":
            assert x.saved == traced[x.name], x.name


def test_qlora_base_weights_are_bitsandbytes_nf4():
    """QLoRA (``base_bits=4``): each decoder layer's Linear weights take the bytes
    bitsandbytes stores for them (``quantize_4bit`` in nf4 with double quantization, what
    ``Linear4bit`` and LLaVA's ``--bits 4`` use: packed weights and quantization state), its
    norms their dtype's; what trains (adapters, projector) is LoRA's at 16 bits."""
    import bitsandbytes.functional as bnb_f

    step = Step.data_parallel(2, "bf16-mixed")
    qlora = replace(LLAVA, lora=LoraSpec(8, base_bits=4))
    fz, fz16 = factorize(qlora, step), factorize(LLAVA, step)
    t = TEXT
    h, f, kv = t.hidden_size, t.ffn, t.kv_heads * (t.hidden_size // t.num_attention_heads)
    stored = 0
    for shape in [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]:
        q, state = bnb_f.quantize_4bit(torch.randn(shape, dtype=torch.bfloat16), blocksize=64,
                                       quant_type="nf4", compress_statistics=True)
        stored += sum(x.nbytes for x in (q, state.absmax, state.code, state.offset,
                                         state.state2.absmax, state.state2.code))
    norms = 2 * h * 2  # two bf16 RMSNorm weights
    for i in range(t.num_layers):
        layer = next(x for x in fz.layers if x.name == f"llm.layers.{i}")
        assert layer.param_bytes == stored + norms and not layer.trainable
        assert sum(layer.tensor_bytes) == layer.param_bytes
    assert [x.params for x in fz.layers if x.trainable] == \
        [x.params for x in fz16.layers if x.trainable]
    est, est16 = walk_phases(qlora, step, HOPPER, fz), walk_phases(LLAVA, step, HOPPER, fz16)
    saved = 2 * sum(x.param_bytes for x in fz16.layers if x.name.startswith("llm.layers.")
                    and x.tower == "llm") - 2 * t.num_layers * (stored + norms)
    assert est16.components["parameters"] - est.components["parameters"] == saved // 2
    assert est.components["optimizer_states"] == est16.components["optimizer_states"]
    with pytest.raises(ModelSpecError, match="base_bits=8"):
        LoraSpec(8, base_bits=8)
