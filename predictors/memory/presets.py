"""Named models (architecture shapes of public checkpoints; weights are never loaded)."""

from __future__ import annotations

from dataclasses import replace

from ..spec.engines import HF_TEXT_FAMILIES
from ..spec.model import (
    LoraSpec,
    ModelSpec,
    TransformerSpec,
    UnknownModelError,
    VisionTowerSpec,
)

PRESET_SEQ = 2048  # the presets' text seq_length (predict_peak_memory's seq replaces it)


def _decoder(family: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int,
             kv_heads: int | None = None, tied: bool = False) -> TransformerSpec:
    return TransformerSpec(family, layers, hidden, heads, PRESET_SEQ, vocab, ffn_hidden_size=ffn,
                           num_query_groups=kv_heads, swiglu=True, tied_embeddings=tied)


CLIP_L_336 = VisionTowerSpec("clip", 24, 1024, 16, 4096, 14, 336)
CLIP_L_224 = VisionTowerSpec("clip", 24, 1024, 16, 4096, 14, 224)
CLIP_B_224 = VisionTowerSpec("clip", 12, 768, 12, 3072, 16, 224)
EVA_G_224 = VisionTowerSpec("clip", 39, 1408, 16, 6144, 14, 224)  # BLIP-2's ViT-g, CLIP-style
SIGLIP_SO_378 = VisionTowerSpec("siglip", 27, 1152, 16, 4304, 14, 378)  # 27x27 patches
SIGLIP_B_224 = VisionTowerSpec("siglip", 12, 768, 12, 3072, 16, 224)
LLAMA_7B = _decoder("llama", 32, 4096, 32, 11008, 32064)
LLAMA_13B = _decoder("llama", 40, 5120, 40, 13824, 32064)
LLAMA_3B = _decoder("llama", 32, 2560, 32, 6912, 50272)
QWEN2_7B = _decoder("qwen2", 28, 3584, 28, 18944, 152064, kv_heads=4)
QWEN2_1_5B = _decoder("qwen2", 28, 1536, 12, 8960, 151936, kv_heads=2, tied=True)

PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llava-1.5-7b-like", "llava", CLIP_L_336, LLAMA_7B),
        ModelSpec("llava-1.5-13b-like", "llava", CLIP_L_336, LLAMA_13B),
        ModelSpec("qwen-vl-7b-like", "qwen-vl", SIGLIP_SO_378, QWEN2_7B),
        ModelSpec("qwen-vl-1.5b-like", "qwen-vl", SIGLIP_SO_378, QWEN2_1_5B),
        # BLIP-2 trains only the bridge between a frozen ViT and a frozen LLM. The bridge here is
        # LLaVA's MLP projector, not a Q-Former (stated simplification).
        ModelSpec("blip2-3b-like", "blip2", EVA_G_224, LLAMA_3B, frozen=("vision", "llm")),
        ModelSpec("llama-7b-like", "llm", None, LLAMA_7B),
        ModelSpec("qwen2-1.5b-like", "llm", None, QWEN2_1_5B),
        ModelSpec("vit-l-like", "vit", CLIP_L_224),
        ModelSpec("vit-b-like", "vit", CLIP_B_224),
        ModelSpec("siglip-b-like", "vit", SIGLIP_B_224),
    )
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownModelError(
            f"model={name!r} is unknown; choose one of {', '.join(PRESETS)}"
        ) from None


def scaled(spec: ModelSpec, width: float, depth: int, vocab: int | None = None) -> ModelSpec:
    """A smaller member of the same family (for cheap ground truth): widths scaled by ``width``
    (rounded to whole heads), ``depth`` layers per tower."""

    def sc(x: int, mult: int) -> int:
        return max(mult, int(x * width) // mult * mult)

    v = spec.vision and replace(
        spec.vision, num_layers=min(depth, spec.vision.num_layers),
        hidden_size=sc(spec.vision.hidden_size, spec.vision.num_attention_heads * 8),
        ffn_hidden_size=sc(spec.vision.ffn_hidden_size, 64))
    t = spec.text and replace(
        spec.text, num_layers=min(depth, spec.text.num_layers),
        hidden_size=sc(spec.text.hidden_size, spec.text.num_attention_heads * 8),
        ffn_hidden_size=sc(spec.text.ffn, 64),
        vocab_size=vocab or spec.text.vocab_size)
    return replace(spec, name=f"{spec.name}@w{width}d{depth}", vision=v, text=t)


def memory_text_tower(t: TransformerSpec) -> TransformerSpec:
    """The decoder the memory predictor walks (and builds through its HF config) for a text
    tower: Llama (RMSNorm, rotary, SwiGLU) or Qwen2 (the same with q/k/v biases) layers as
    given; a tower of another family (GPT: GELU MLP) as the Llama layer with the same MLP
    parameter count (SwiGLU width 2/3 of the FFN)."""
    if t.family in HF_TEXT_FAMILIES and t.swiglu:
        return t
    return replace(t, family="llama", swiglu=True,
                   ffn_hidden_size=t.ffn if t.swiglu else 2 * t.ffn // 3)


def as_memory_model(model: str | ModelSpec | TransformerSpec, *, seq: int | None = None,
                    image_res: int | None = None, images_per_sample: int | None = None,
                    attention: str | None = None,
                    frozen: tuple[str, ...] | None = None,
                    lora: LoraSpec | None = None) -> ModelSpec:
    """A preset name, a model or a text tower alone, as the model the memory predictor walks;
    the keywords set the model's own facts (None keeps them): the text tower's sequence length
    (image tokens included), the vision tower's resolution, images per sample, the attention
    implementation of every tower, the frozen towers and LoRA adapters on the text tower
    (whose own weights they freeze)."""
    if isinstance(model, str):
        model = get_preset(model)
    elif isinstance(model, TransformerSpec):
        model = ModelSpec(f"{model.family}-{model.num_layers}l-h{model.hidden_size}", "llm",
                          text=model)
    if model.text is not None:
        model = replace(model, text=memory_text_tower(model.text))
    model = model.with_seq(seq).at_resolution(image_res)
    if attention is not None:
        model = model.with_attention(attention)
    if images_per_sample is not None:
        model = replace(model, images_per_sample=images_per_sample)
    if lora is not None:
        model = replace(model, lora=lora)
    return model if frozen is None else replace(model, frozen=frozen)
