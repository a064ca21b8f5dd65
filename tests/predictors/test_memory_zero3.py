"""One ZeRO-3 model for both paths, and a LLaVA-style step (frozen vision tower, ZeRO-3,
activation checkpointing) against states computed by hand."""

from dataclasses import replace

import pytest
import torch

from predictors.memory.config import Step
from predictors.memory.device import CommBuffers
from predictors.memory.factorize import factorize
from predictors.memory.module import predict_module_memory
from predictors.memory.overheads import HOPPER
from predictors.memory.phases import walk_phases
from predictors.memory.presets import get_preset
from predictors.memory.replay import replay_reserved
from predictors.memory.zero import deepspeed_step, sub_groups, zero3_params
from predictors.spec import ParallelStrategy, StrategyError, TrainingOptions, foreach_temporaries

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


def test_deepspeed_sub_groups_follow_its_partitioning():
    # stage3.py _create_fp16_sub_groups: whole group when it fits, else parameters in order
    # until their partitions reach sub_group_size (the last group takes the rest)
    assert sub_groups([3, 4], 10) == [7]
    assert sub_groups([6, 5, 4, 3], 10) == [11, 7]
    assert sub_groups([10, 10, 1], 10) == [10, 10, 1]


def test_deepspeed_step_bytes_hand_computed():
    # three tensors over dp=2 in bf16, sub-groups of 1e9 partition elements: each partition
    # (1.5e9, 1.5e9, 1e9) is its own sub-group; the bf16 flat gradient buffer holds all four
    # billion; the largest sub-group steps with its fp32 gradient and torch 2.0's two foreach
    # AdamW temporaries (12 B per element), more than its bf16 flat copy beside the fp32 cast
    ds = deepspeed_step([3 * 10**9, 3 * 10**9, 2 * 10**9], dp=2, zero=3, elem=2,
                        optimizer_temporaries=2)
    assert ds.groups == (15 * 10**8, 15 * 10**8, 10**9)
    assert ds.peak(2) == 4 * 10**9 * 2 + 15 * 10**8 * 12
    # stage 2 steps the whole partition; torch >= 2.1 keeps one temporary
    ds2 = deepspeed_step([3 * 10**9, 3 * 10**9, 2 * 10**9], dp=2, zero=2, elem=2)
    assert ds2.groups == (4 * 10**9,) and ds2.peak(2) == 4 * 10**9 * (2 + 8)


def _llava_deepspeed_zero3():
    """A 2+2-layer LLaVA-7B-like step under DeepSpeed ZeRO-3 over 8 ranks (torch < 2.1's two
    AdamW temporaries), and each trainable tensor's partition on a rank."""
    spec = replace(get_preset("llava-1.5-7b-like").with_layers(2, 2).with_seq(1024),
                   frozen=("vision",))
    opts = TrainingOptions.for_zero_stage(3, recompute="full", framework="deepspeed",
                                          foreach_temporaries=foreach_temporaries("2.0.1"))
    cfg = Step(ParallelStrategy(8, 1, 1, micro_batch=2), opts, "bf16-mixed")
    fz = factorize(spec, cfg)
    return spec, cfg, fz, [-(-n // 8) for x in fz.layers if x.trainable for n in x.tensor_params]


def test_preset_walk_steps_deepspeed_zero3_by_sub_group():
    spec, cfg, fz, parts = _llava_deepspeed_zero3()
    shard = sum(parts)  # one sub-group: the rank's partition is below 1e9 elements
    est = walk_phases(spec, cfg, HOPPER, fz)
    megatron = walk_phases(spec, replace(cfg, options=TrainingOptions.for_zero_stage(
        3, recompute="full")), HOPPER, fz)
    # Megatron-style: fp32 gradients of the shard; DeepSpeed: its bf16 flat buffer, the fp32
    # gradient and two fp32 temporaries of the one sub-group
    ds_grads = shard * 2 + shard * 4 * 3
    assert (est.phase_peaks["optimizer"] - ds_grads
            == megatron.phase_peaks["optimizer"] - _megatron_step_grads(fz, 8))
    assert est.phase_peaks["optimizer"] > megatron.phase_peaks["optimizer"]


def _megatron_step_grads(fz, dp):
    trainable = sum(x.params for x in fz.layers if x.trainable)
    grads = [x.param_bytes // dp for x in fz.layers if x.trainable]
    return trainable * 4 // dp + max(grads) // len(fz.layers)


def test_replay_holds_the_deepspeed_step():
    # the replayed reserved peak holds what the step keeps live: the rank's bf16 shard, fp32
    # masters and Adam states, the bf16 gradient buffer, the sub-group's fp32 gradient and
    # its two temporaries; Megatron's step (fp32 gradients of the shard) holds less
    spec, cfg, fz, parts = _llava_deepspeed_zero3()
    total = sum(x.params for x in fz.layers)
    live = total * 2 // 8 + sum(parts) * (12 + 2) + sum(parts) * 12
    ds = replay_reserved(fz, cfg, HOPPER)
    meg = replay_reserved(fz, replace(cfg, options=TrainingOptions.for_zero_stage(
        3, recompute="full")), HOPPER)
    assert ds >= live
    assert ds > meg


def test_foreach_temporaries_follow_the_torch_version():
    # torch 2.1 dropped foreach AdamW's second parameter-sized temporary (pytorch#104780)
    assert [foreach_temporaries(v) for v in ("1.13.1", "2.0.1", "2.1.2+cu121", "2.11.0")] \
        == [2, 2, 1, 1]
    with pytest.raises(StrategyError, match="torch_version='nightly'"):
        foreach_temporaries("nightly")
