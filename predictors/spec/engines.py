"""The one spec to and from the engines' own configurations: Hugging Face ``transformers``
configs (the memory predictor builds its modules from them), vLLM's ``ModelConfig``,
Megatron-Core's ``TransformerConfig`` and Megatron-LM's command-line flags. Each engine is
imported only by the function that needs it.

A field an engine does not carry comes as an argument (HF configs have no training sequence
length: ``max_position_embeddings`` stands in; Megatron-Core's ``TransformerConfig`` has no
vocabulary or sequence length). GQA with as many groups as heads is multi-head attention, so
``num_query_groups`` comes back ``None`` there."""

from __future__ import annotations

import argparse
from typing import Any

from .model import TransformerSpec, UnknownModelError, VisionTowerSpec
from .options import TrainingOptions
from .precision import UnknownPrecisionError, get_precision
from .strategy import ParallelStrategy, StrategyError

HF_TEXT_FAMILIES = ("llama", "qwen2")  # SwiGLU decoders with an HF config of their own


def _groups(kv_heads: int | None, heads: int) -> int | None:
    return None if kv_heads in (None, heads) else kv_heads


def hf_text_config(t: TransformerSpec, **overrides: Any):
    """``LlamaConfig`` / ``Qwen2Config`` of a text tower (``overrides`` set further fields)."""
    from transformers import LlamaConfig, Qwen2Config

    if t.family not in HF_TEXT_FAMILIES or not t.swiglu:
        raise UnknownModelError(f"text family={t.family!r} (swiglu={t.swiglu}) has no HF config "
                                f"here; choose one of {HF_TEXT_FAMILIES} with swiglu=True")
    cls = LlamaConfig if t.family == "llama" else Qwen2Config
    fields = dict(hidden_size=t.hidden_size, intermediate_size=t.ffn,
                  num_hidden_layers=t.num_layers, num_attention_heads=t.num_attention_heads,
                  num_key_value_heads=t.kv_heads, vocab_size=t.vocab_size,
                  tie_word_embeddings=t.tied_embeddings,
                  max_position_embeddings=t.seq_length)  # fmt: skip
    return cls(**{**fields, **overrides})


def text_spec_from_hf(cfg, seq_length: int | None = None) -> TransformerSpec:
    """The text tower of an HF Llama/Qwen2 config (``seq_length``: default its
    ``max_position_embeddings``)."""
    if cfg.model_type not in HF_TEXT_FAMILIES:
        raise UnknownModelError(f"HF model_type={cfg.model_type!r} is not one of "
                                f"{HF_TEXT_FAMILIES}")
    return TransformerSpec(
        cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
        seq_length or cfg.max_position_embeddings, cfg.vocab_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_query_groups=_groups(cfg.num_key_value_heads, cfg.num_attention_heads),
        swiglu=True, tied_embeddings=bool(cfg.tie_word_embeddings))


def hf_vision_config(v: VisionTowerSpec, **overrides: Any):
    """``CLIPVisionConfig`` / ``SiglipVisionConfig`` of a vision tower."""
    from transformers import CLIPVisionConfig, SiglipVisionConfig

    cls = CLIPVisionConfig if v.family == "clip" else SiglipVisionConfig
    fields = dict(hidden_size=v.hidden_size, intermediate_size=v.ffn_hidden_size,
                  num_hidden_layers=v.num_layers, num_attention_heads=v.num_attention_heads,
                  image_size=v.image_size, patch_size=v.patch_size)  # fmt: skip
    return cls(**{**fields, **overrides})


def vision_spec_from_hf(cfg) -> VisionTowerSpec:
    family = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}.get(cfg.model_type)
    if family is None:
        raise UnknownModelError(f"HF model_type={cfg.model_type!r} is not a CLIP/SigLIP ViT")
    return VisionTowerSpec(family, cfg.num_hidden_layers, cfg.hidden_size,
                           cfg.num_attention_heads, cfg.intermediate_size, cfg.patch_size,
                           cfg.image_size)  # fmt: skip


def text_spec_from_vllm(model_config) -> TransformerSpec:
    """The text tower of a vLLM ``ModelConfig`` (its ``max_model_len`` as the sequence)."""
    return text_spec_from_hf(model_config.hf_text_config, model_config.max_model_len)


def megatron_transformer_config(t: TransformerSpec, strategy: ParallelStrategy,
                                precision: str = "bf16-mixed", **overrides: Any):
    """Megatron-Core's ``TransformerConfig`` of a text tower under ``strategy`` at a Megatron
    precision of the table (SwiGLU as Megatron's gated SiLU linear unit)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    p = get_precision(precision)
    if p.megatron_flag is None:
        raise UnknownPrecisionError(f"precision={precision!r} has no Megatron-LM flag")
    fields = dict(bf16=p.compute_dtype == torch.bfloat16, fp16=p.compute_dtype == torch.float16,
                  params_dtype=p.param_dtype, pipeline_dtype=p.compute_dtype,
                  num_layers=t.num_layers, hidden_size=t.hidden_size,
                  num_attention_heads=t.num_attention_heads, num_query_groups=t.kv_heads,
                  ffn_hidden_size=t.ffn, gated_linear_unit=t.swiglu,
                  activation_func=F.silu if t.swiglu else F.gelu,
                  tensor_model_parallel_size=strategy.tp,
                  pipeline_model_parallel_size=strategy.pp,
                  context_parallel_size=strategy.cp)  # fmt: skip
    return TransformerConfig(**{**fields, **overrides})


def text_spec_from_megatron(cfg, family: str, seq_length: int, vocab_size: int,
                            tied_embeddings: bool = True) -> TransformerSpec:
    """The text tower of a Megatron-Core ``TransformerConfig`` (it carries no vocabulary,
    sequence length or embedding tying: Megatron passes those to ``GPTModel``)."""
    return TransformerSpec(
        family, cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, seq_length, vocab_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_query_groups=_groups(cfg.num_query_groups, cfg.num_attention_heads),
        swiglu=bool(cfg.gated_linear_unit), tied_embeddings=tied_embeddings)


def megatron_args(t: TransformerSpec, strategy: ParallelStrategy,
                  options: TrainingOptions | None = None) -> list[str]:
    """Megatron-LM's flags for a text tower, strategy and options (as ``pretrain_gpt.py``
    takes them; a flag at its Megatron default is left out)."""
    options = options or TrainingOptions()
    argv = ["--num-layers", t.num_layers, "--hidden-size", t.hidden_size,
            "--num-attention-heads", t.num_attention_heads, "--seq-length", t.seq_length,
            "--max-position-embeddings", t.seq_length, "--ffn-hidden-size", t.ffn,
            "--micro-batch-size", strategy.micro_batch,
            "--global-batch-size", strategy.global_batch_size,
            "--tensor-model-parallel-size", strategy.tp,
            "--pipeline-model-parallel-size", strategy.pp]  # fmt: skip
    if t.num_query_groups is not None:
        argv += ["--group-query-attention", "--num-query-groups", t.num_query_groups]
    if strategy.cp > 1:
        argv += ["--context-parallel-size", strategy.cp]
    if strategy.first_stage_layers is not None:
        argv += ["--decoder-first-pipeline-num-layers", strategy.first_stage_layers]
    if strategy.last_stage_layers is not None:
        argv += ["--decoder-last-pipeline-num-layers", strategy.last_stage_layers]
    if options.virtual_pipeline > 1:
        argv += ["--num-layers-per-virtual-pipeline-stage",
                 t.num_layers // (strategy.pp * options.virtual_pipeline)]
    flags = {"--swiglu": t.swiglu, "--untie-embeddings-and-output-weights": not t.tied_embeddings,
             "--use-distributed-optimizer": options.distributed_optimizer,
             "--overlap-grad-reduce": options.overlap_grad_reduce,
             "--overlap-param-gather": options.overlap_param_gather,
             "--tp-comm-overlap": options.tp_comm_overlap,
             "--sequence-parallel": options.sequence_parallel,
             "--accumulate-allreduce-grads-in-fp32": options.accumulate_allreduce_grads_in_fp32,
             "--use-flash-attn": t.attention == "flash"}  # fmt: skip
    argv += [f for f, on in flags.items() if on]
    if not options.overlap_p2p_comm:
        argv.append("--no-overlap-p2p-communication")
    if options.recompute != "none":
        argv += ["--recompute-granularity", options.recompute]
        if options.recompute == "full":
            argv += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return [str(a) for a in argv]


def text_spec_from_megatron_args(args: argparse.Namespace, family: str | None = None,
                                 vocab_size: int | None = None) -> TransformerSpec:
    """The text tower of parsed Megatron-LM flags. ``family`` None: Llama-style where
    ``--normalization RMSNorm``, else GPT-style. A flag the parser does not define reads as its
    Megatron default."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if family is None:
        family = "llama" if get("normalization", "LayerNorm") == "RMSNorm" else "gpt"
    vocab = vocab_size or get("padded_vocab_size") or 50304
    groups = get("num_query_groups") if get("group_query_attention", True) else None
    return TransformerSpec(
        family, args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
        vocab, ffn_hidden_size=get("ffn_hidden_size"),
        num_query_groups=_groups(groups, args.num_attention_heads), swiglu=bool(get("swiglu")),
        tied_embeddings=not get("untie_embeddings_and_output_weights", False),
        attention="flash" if get("use_flash_attn", True) else "unfused")


def from_megatron_args(args: argparse.Namespace, world_size: int, family: str = "gpt",
                       vocab_size: int | None = None
                       ) -> tuple[TransformerSpec, ParallelStrategy, TrainingOptions]:  # fmt: skip
    """Text tower, strategy and options of parsed Megatron-LM flags on ``world_size`` ranks
    (data parallelism is what TP x PP x CP leave, as Megatron derives it). A flag the parser
    does not define reads as its Megatron default."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    tp, pp, cp = (get(f, 1) or 1 for f in ("tensor_model_parallel_size",
                                         "pipeline_model_parallel_size",
                                         "context_parallel_size"))
    if world_size % (tp * pp * cp):
        raise StrategyError(f"world_size={world_size} is not divisible by tp*pp*cp={tp * pp * cp}")
    spec = text_spec_from_megatron_args(args, family, vocab_size)
    strategy = ParallelStrategy(world_size // (tp * pp * cp), tp, pp, args.micro_batch_size,
                                get("global_batch_size"), cp,
                                get("decoder_first_pipeline_num_layers"),
                                get("decoder_last_pipeline_num_layers"))  # fmt: skip
    per_stage = get("num_layers_per_virtual_pipeline_stage")
    options = TrainingOptions(
        overlap_grad_reduce=bool(get("overlap_grad_reduce")),
        tp_comm_overlap=bool(get("tp_comm_overlap")),
        virtual_pipeline=args.num_layers // (pp * per_stage) if per_stage else 1,
        distributed_optimizer=bool(get("use_distributed_optimizer")),
        overlap_param_gather=bool(get("overlap_param_gather")),
        sequence_parallel=bool(get("sequence_parallel")),
        accumulate_allreduce_grads_in_fp32=bool(get("accumulate_allreduce_grads_in_fp32")),
        overlap_p2p_comm=bool(get("overlap_p2p_comm", True)),
        recompute=get("recompute_granularity") or "none")
    return spec, strategy, options
