"""One ZeRO-3 model for both paths, and a LLaVA-style step (frozen vision tower, ZeRO-3,
activation checkpointing) against states computed by hand."""

from dataclasses import replace

import torch

from predictors.memory.config import Step
from predictors.memory.device import CommBuffers
from predictors.memory.factorize import factorize
from predictors.memory.module import predict_module_memory
from predictors.memory.overheads import HOPPER
from predictors.memory.phases import walk_phases
from predictors.memory.presets import get_preset
from predictors.memory.zero import zero3_params
from predictors.spec import ParallelStrategy, TrainingOptions

MB = 2**20


def test_llava_frozen_vision_zero3_checkpointing_hand_computed():
    spec = replace(get_preset("llava-1.5-7b-like").with_layers(2, 2).with_seq(1024),
                   frozen=("vision",))
    cfg = Step(ParallelStrategy(8, 1, 1, micro_batch=2),
               TrainingOptions.for_zero_stage(3, recompute="full"), "bf16-mixed")
    # parameters by hand (CLIP-L/14 at 336 px, LLaMA-7B shapes, LLaVA's 2-layer MLP projector)
    hv, fv, h, f, vocab = 1024, 4096, 4096, 11008, 32064
    vis_embed = 3 * 14 * 14 * hv + hv + (24 * 24 + 1) * hv + 2 * hv  # patch conv, cls, pos, LN
    vis_layer = 4 * (hv * hv + hv) + 4 * hv + (hv * fv + fv + fv * hv + hv)
    vis_post = 2 * hv
    projector = hv * h + h + h * h + h
    llm_layer = 4 * h * h + 3 * h * f + 2 * h
    embed, head = vocab * h, vocab * h + h  # untied head + final norm
    trainable = projector + embed + 2 * llm_layer + head
    total = vis_embed + 2 * vis_layer + vis_post + trainable
    # bf16 weights; fp32 master + Adam m, v (12 B) sharded 8 ways; one 512 B step per tensor
    tensors = 4 + 1 + 2 * 9 + 2
    states = trainable * 12 // 8 + tensors * 512
    # ZeRO-3: the 1/8 shard, the tiny post-LN kept whole (< 1e5 elements), the largest module
    # (one LLaMA layer) gathered, the 5e7-element prefetch bucket
    params = total * 2 // 8 + (vis_post * 2 - vis_post * 2 // 8) + llm_layer * 2 + int(5e7 * 2)
    est = walk_phases(spec, cfg, HOPPER, factorize(spec, cfg))
    assert est.components["optimizer_states"] == states
    assert est.components["parameters"] == params
    # full checkpointing: each LLaMA layer keeps only its bf16 input; the frozen tower none
    fz = factorize(spec, cfg)
    saved = {x.name: x.saved for x in fz.layers}
    assert saved["llm.layers.0"] == saved["llm.layers.1"] == 2 * 1024 * h * 2
    assert all(v == 0 for k, v in saved.items() if k.startswith("vision"))


def test_module_path_uses_the_same_zero3_model():
    def build():
        return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                   torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512))  # fmt: skip

    x, y = torch.randn(8, 512), torch.randn(8, 512)
    p = predict_module_memory(build, x, y, strategy=ParallelStrategy(4, 1, 1),
                              options=TrainingOptions.for_zero_stage(3, framework="deepspeed"),
                              buffers=CommBuffers(prefetch_bucket=1e5), precision="fp32")
    fc1, fc2, ln = [512 * 2048 * 4, 2048 * 4], [2048 * 512 * 4, 512 * 4], [512 * 4, 512 * 4]
    z3 = zero3_params([fc1, fc2, ln], 4, 4, prefetch_bucket=1e5)
    assert p.inside_allocator["ds_stage3_gathered_module"] == z3.gathered == sum(fc1)
    assert p.inside_allocator["ds_prefetch_bucket"] == z3.prefetch == int(1e5 * 4)
    # biases and the LayerNorm (< 1e5 elements) stay whole; the weights are sharded
    assert z3.persistent == (2048 + 512 + 1024) * 4 - (2048 + 512 + 1024) * 4 // 4
