"""Model and training-step descriptions for the memory predictor.

A multimodal model is a set of *towers*: an optional vision encoder (CLIP or SigLIP ViT), a
projector (LLaVA's 2-layer GELU MLP or a single Linear) and an optional language model (Llama or
Qwen2 decoder); a ViT alone gets a linear classification head. ``build.py`` turns these specs
into real ``transformers`` modules (random init, nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..precision import Precision, get_precision


class MemorySpecError(ValueError):
    """Base of the named errors for a model or training configuration that cannot be built."""


class UnknownModelError(MemorySpecError):
    """A model preset or tower kind that does not exist."""


class ResolutionError(MemorySpecError):
    """Image resolution not divisible by the patch size (or too many image tokens)."""


class ShardingError(MemorySpecError):
    """A ZeRO stage / data-parallel degree combination that cannot shard this model."""


VISION_KINDS = ("clip", "siglip")
TEXT_KINDS = ("llama", "qwen2")
PROJECTORS = ("mlp2x_gelu", "linear")
CHECKPOINTING = ("none", "full")
ATTENTION = ("flash", "eager")
TOWERS = ("vision", "projector", "llm", "head")


@dataclass(frozen=True)
class VisionTowerSpec:
    kind: str  # clip | siglip
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    image_size: int = 336  # the resolution the position table is built for

    def __post_init__(self) -> None:
        if self.kind not in VISION_KINDS:
            raise UnknownModelError(f"vision kind={self.kind!r} is unknown; choose {VISION_KINDS}")
        if self.image_size % self.patch_size:
            raise ResolutionError(
                f"vision image_size={self.image_size} is not divisible by patch_size="
                f"{self.patch_size}"
            )

    @property
    def has_cls(self) -> bool:
        return self.kind == "clip"

    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class TextTowerSpec:
    kind: str  # llama | qwen2
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kind not in TEXT_KINDS:
            raise UnknownModelError(f"text kind={self.kind!r} is unknown; choose {TEXT_KINDS}")
        if self.hidden_size % self.num_heads or self.num_heads % self.kv_heads:
            raise MemorySpecError(
                f"text hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.kv_heads} do not divide"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


@dataclass(frozen=True)
class ModelSpec:
    """A model: its family (for held-out evaluation), towers and projector type."""

    name: str
    family: str  # llava | qwen-vl | blip2 | llm | vit
    vision: VisionTowerSpec | None = None
    text: TextTowerSpec | None = None
    projector: str = "mlp2x_gelu"
    num_classes: int = 1000  # ViT classification head (no text tower)
    default_frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.vision is None and self.text is None:
            raise MemorySpecError(f"model {self.name!r} has neither a vision nor a text tower")
        if self.projector not in PROJECTORS:
            raise UnknownModelError(f"projector={self.projector!r} unknown; choose {PROJECTORS}")

    @property
    def multimodal(self) -> bool:
        return self.vision is not None and self.text is not None

    def at_resolution(self, image_res: int | None) -> ModelSpec:
        """The same model with its vision position table built for ``image_res``."""
        if self.vision is None or image_res is None or image_res == self.vision.image_size:
            return self
        return replace(self, vision=replace(self.vision, image_size=image_res))

    def with_layers(self, vision_layers: int | None, text_layers: int | None) -> ModelSpec:
        v = self.vision and replace(self.vision, num_layers=vision_layers or self.vision.num_layers)
        t = self.text and replace(self.text, num_layers=text_layers or self.text.num_layers)
        return replace(self, vision=v, text=t)


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
            raise MemorySpecError(
                f"batch={self.batch}, seq={self.seq}, images_per_sample="
                f"{self.images_per_sample} must be positive"
            )
        get_precision(self.precision)
        if self.zero not in (0, 1, 2, 3):
            raise ShardingError(f"zero={self.zero} must be one of 0, 1, 2, 3")
        if self.dp < 1:
            raise ShardingError(f"dp={self.dp} must be >= 1")
        if self.checkpointing not in CHECKPOINTING:
            raise MemorySpecError(f"checkpointing={self.checkpointing!r}; choose {CHECKPOINTING}")
        if self.attention not in ATTENTION:
            raise MemorySpecError(f"attention={self.attention!r}; choose {ATTENTION}")
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
