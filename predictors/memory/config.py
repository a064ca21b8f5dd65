"""One GPU's training step as the memory predictor walks it (:class:`TrainConfig`), and the token
counts a model and step imply. The model is :class:`predictors.spec.ModelSpec` (towers:
an optional vision encoder, a projector, an optional language model; a ViT alone gets a linear
classification head); ``build.py`` turns it into real ``transformers`` modules (random init,
nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.model import ModelSpec, ModelSpecError, ResolutionError, UnknownModelError
from ..spec.precision import Precision, get_precision


class ShardingError(ModelSpecError):
    """A ZeRO stage / data-parallel degree combination that cannot shard this model."""


CHECKPOINTING = ("none", "full")
ATTENTION = ("flash", "eager")
TOWERS = ("vision", "projector", "llm", "head")


@dataclass(frozen=True)
class TrainConfig:
    """One training step on one GPU (data-parallel degree only shards under ZeRO)."""

    batch: int = 1
    seq: int = 512  # LLM sequence length, image tokens included
    image_res: int | None = None  # None: the vision tower's native resolution
    images_per_sample: int = 1
    precision: str = "bf16"
    zero: int = 0  # 0: plain DDP, 1: optimizer states (+fp32 master), 2: +grads, 3: +params
    dp: int = 1
    checkpointing: str = "none"
    attention: str = "flash"
    frozen: tuple[str, ...] | None = None  # None: the model's default_frozen

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1 or self.images_per_sample < 0:
            raise ModelSpecError(
                f"batch={self.batch}, seq={self.seq}, images_per_sample="
                f"{self.images_per_sample} must be positive"
            )
        get_precision(self.precision)
        if self.zero not in (0, 1, 2, 3):
            raise ShardingError(f"zero={self.zero} must be one of 0, 1, 2, 3")
        if self.dp < 1:
            raise ShardingError(f"dp={self.dp} must be >= 1")
        if self.checkpointing not in CHECKPOINTING:
            raise ModelSpecError(f"checkpointing={self.checkpointing!r}; choose {CHECKPOINTING}")
        if self.attention not in ATTENTION:
            raise ModelSpecError(f"attention={self.attention!r}; choose {ATTENTION}")
        for t in self.frozen or ():
            if t not in TOWERS:
                raise UnknownModelError(f"frozen tower {t!r} unknown; choose from {TOWERS}")

    @property
    def prec(self) -> Precision:
        return get_precision(self.precision)

    def frozen_towers(self, model: ModelSpec) -> tuple[str, ...]:
        return model.default_frozen if self.frozen is None else self.frozen


@dataclass(frozen=True)
class Shapes:
    """Token counts a (model, config) pair implies."""

    images: int  # images in the step
    patches: int  # patch tokens per image (no CLS)
    vision_tokens: int  # tokens per image inside the ViT (CLS included for CLIP)
    image_tokens: int  # tokens each sample's images contribute to the LLM sequence
    seq: int


def resolve_shapes(model: ModelSpec, cfg: TrainConfig) -> Shapes:
    """Check resolution/sequence consistency and derive token counts (named errors if not)."""
    if model.vision is None:
        return Shapes(0, 0, 0, 0, cfg.seq)
    v = model.vision
    res = cfg.image_res or v.image_size
    if res % v.patch_size:
        raise ResolutionError(
            f"image_res={res} is not divisible by the vision patch_size={v.patch_size}"
        )
    if res != v.image_size:
        raise ResolutionError(
            f"image_res={res} differs from the vision tower's image_size={v.image_size}; "
            "build the model at that resolution (its position table depends on it)"
        )
    patches = (res // v.patch_size) ** 2
    images = cfg.batch * max(cfg.images_per_sample, 1)
    image_tokens = patches * max(cfg.images_per_sample, 1)
    if model.text is not None and image_tokens >= cfg.seq:
        raise ResolutionError(
            f"seq={cfg.seq} must exceed the {image_tokens} image tokens of "
            f"{max(cfg.images_per_sample, 1)} image(s) at image_res={res}"
        )
    return Shapes(images, patches, patches + int(v.has_cls), image_tokens, cfg.seq)
