"""Build real ``transformers`` modules (random init, no hub access) from a :class:`ModelSpec`."""

from __future__ import annotations

import types

import torch
from torch import nn

from ..spec.engines import hf_text_config, hf_vision_config
from ..spec.model import ModelSpec, TransformerSpec, VisionTowerSpec
from . import kernels

# the spec's attention (predictors.spec.ATTENTION_IMPLS) as transformers names it; "sdpa" is
# the real-GPU stand-in for "flash"
_ATTN_IMPL = {"flash": kernels.ATTN_IMPL, "unfused": "eager", "sdpa": "sdpa"}


def vision_config(v: VisionTowerSpec, attention: str = "flash"):
    cfg = hf_vision_config(v)
    cfg._attn_implementation = _ATTN_IMPL[attention]
    return cfg


def text_config(t: TransformerSpec, attention: str = "flash"):
    # training: no KV cache (HF keeps its tensors alive otherwise); a position range long
    # enough for every traced step, whatever the spec's seq_length
    cfg = hf_text_config(t, max_position_embeddings=32768, use_cache=False)
    cfg._attn_implementation = _ATTN_IMPL[attention]
    return cfg


def _placeholder_mask(self, input_ids, inputs_embeds, image_features):
    """LLaVA's image-token mask without its token-count check: that check reads a value back to
    the host, which fake tensors cannot do. Same ops (and allocations) otherwise."""
    mask = input_ids == self.config.image_token_id
    mask.sum()
    return mask.unsqueeze(-1).to(inputs_embeds.device)


class ViTClassifier(nn.Module):
    """A ViT (CLIP/SigLIP vision model) with a linear head on the pooled output."""

    def __init__(self, vision: nn.Module, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.vision_tower = vision
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pooled = self.vision_tower(pixel_values=pixel_values).pooler_output
        return nn.functional.cross_entropy(self.head(pooled), labels)


def build_model(spec: ModelSpec, attention: str = "flash", emulate: bool = True) -> nn.Module:
    """Instantiate the model on the current default device (use under FakeTensorMode).

    Weight initialisation is skipped: values are irrelevant to memory, and some initialisers
    (truncated normal) read data back to the host, which fake tensors cannot. ``emulate=False``
    (real GPU runs) uses PyTorch's SDPA instead of the FlashAttention memory emulation."""
    from transformers.initialization import no_init_weights

    kernels.register()
    if not emulate and attention == "flash":
        attention = "sdpa"
    with no_init_weights():
        return _build(spec, attention)


def _build(spec: ModelSpec, attention: str) -> nn.Module:
    from transformers import (
        AutoModelForCausalLM,
        CLIPVisionModel,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionModel,
    )

    if spec.multimodal:
        v, t = spec.vision, spec.text
        cfg = LlavaConfig(
            vision_config=vision_config(v, attention),
            text_config=text_config(t, attention),
            projector_hidden_act="gelu",
            vision_feature_layer=-2,
            vision_feature_select_strategy="default" if v.has_cls else "full",
            image_seq_length=v.num_patches(),
            multimodal_projector_bias=True,
            tie_word_embeddings=t.tied_embeddings,
        )
        cfg._attn_implementation = _ATTN_IMPL[attention]
        model = LlavaForConditionalGeneration(cfg)
        model.model.get_placeholder_mask = types.MethodType(_placeholder_mask, model.model)
        if spec.projector == "linear":
            model.model.multi_modal_projector = nn.Linear(v.hidden_size, t.hidden_size)
        return model
    if spec.text is not None:
        model = AutoModelForCausalLM.from_config(text_config(spec.text, attention))
        if spec.text.tied_embeddings:  # skipped together with the initialisation
            model.lm_head.weight = model.model.embed_tokens.weight
        return model
    v = spec.vision
    cls = CLIPVisionModel if v.family == "clip" else SiglipVisionModel
    return ViTClassifier(cls(vision_config(v, attention)), v.hidden_size, spec.num_classes)


def tower_modules(spec: ModelSpec, model: nn.Module) -> dict[str, nn.Module]:
    """The named towers of a built model (the decomposition's top level)."""
    if spec.multimodal:
        inner = model.model
        parts = (inner.vision_tower, inner.multi_modal_projector,
                 nn.ModuleList([inner.language_model, model.lm_head]))
    elif spec.text is not None:
        parts = (model,)
    else:
        parts = (model.vision_tower, model.head)
    return dict(zip(spec.towers, parts, strict=True))


def make_inputs(spec: ModelSpec, model: nn.Module, batch: int, seq: int,
                images_per_sample: int = 1) -> dict[str, torch.Tensor]:
    """Random inputs of the right shapes (image tokens placed at the start of each sample)."""
    kw: dict[str, torch.Tensor] = {}
    if spec.vision is not None:
        v = spec.vision
        n_img = batch * max(images_per_sample, 1) if spec.multimodal else batch
        kw["pixel_values"] = torch.randn(n_img, 3, v.image_size, v.image_size)
    if spec.text is None:
        kw["labels"] = torch.zeros(batch, dtype=torch.long)
        return kw
    ids = torch.ones(batch, seq, dtype=torch.long)
    if spec.multimodal:
        n_tok = spec.vision.num_patches() * max(images_per_sample, 1)
        ids[:, :n_tok] = model.config.image_token_id
    kw["input_ids"] = ids
    kw["labels"] = ids.clone()
    return kw
