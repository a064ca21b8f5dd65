"""The model a job trains: a transformer text tower (GPT/Llama/Qwen2/BERT-like) and, for a
multimodal model, a vision tower (CLIP or SigLIP ViT) and a projector between them
(:class:`ModelSpec`). The time predictor prices a text tower, the memory predictor any of them;
both, CONA and the CLIs speak these types."""

from __future__ import annotations

from dataclasses import dataclass, replace


class ModelSpecError(ValueError):
    """Base of the named errors for a model description that cannot be built."""


class UnknownModelError(ModelSpecError):
    """A model preset or tower family that does not exist."""


class ResolutionError(ModelSpecError):
    """Image resolution not divisible by the patch size (or too many image tokens)."""


ATTENTION_IMPLS = ("flash", "unfused")
VISION_FAMILIES = ("clip", "siglip")
PROJECTORS = ("mlp2x_gelu", "linear")
TOWERS = ("vision", "projector", "llm", "head")  # what a model may train with frozen weights


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder (GPT/Llama/Qwen2-like) or encoder (BERT-like) transformer stack: the text tower.
    ``seq_length`` is the sequence length it is trained at."""

    family: str  # "gpt" | "llama" | "qwen2" (biased q/k/v) | "bert" | ...
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # default 4*hidden (gpt/bert) or SwiGLU 8/3*hidden
    num_query_groups: int | None = None  # GQA; None = multi-head
    swiglu: bool = False
    tied_embeddings: bool = True
    # "flash": one fused attention kernel (SDPA / flash-attn); "unfused": Megatron's classic
    # core attention (no --use-flash-attn): a [b*heads, s, s] scores GEMM, one fused
    # scale-mask-softmax kernel, dropout on the probabilities and a second batched GEMM
    attention: str = "flash"
    # the part of a pipeline stage (Megatron-Core's GPTModel ``pre_process`` / ``post_process``):
    # the input embedding sits on the first stage, the final norm, output layer and loss on the
    # last (with tied embeddings the last stage keeps its own copy of the word embeddings);
    # both on one GPU. Set by :meth:`ModelSpec.pipeline_stage`
    holds_embedding: bool = True
    holds_head: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_IMPLS:
            raise ModelSpecError(f"attention={self.attention!r} must be one of {ATTENTION_IMPLS}")
        # ``not >= 1`` also catches NaN; a zero or negative size would otherwise reach torch
        # (a negative dimension) or price a model of nothing
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "ffn_hidden_size", "num_query_groups"):
            value = getattr(self, name)
            if value is not None and not value >= 1:
                raise ModelSpecError(f"text {name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise ModelSpecError(
                f"text hidden_size={self.hidden_size}, num_attention_heads="
                f"{self.num_attention_heads}, num_query_groups={self.kv_heads} do not divide"
            )

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn, self.vocab_size
        head_dim = h // self.num_attention_heads
        attn = h * h + 2 * h * self.kv_heads * head_dim + h * h
        mlp = (3 if self.swiglu else 2) * h * f
        per_layer = attn + mlp + 4 * h
        # the output layer shares the embedding's weight only where both sit on one stage
        own_head = self.holds_head and not (self.tied_embeddings and self.holds_embedding)
        emb = (v * h + self.seq_length * h if self.holds_embedding else 0) + (
            v * h if own_head else 0)
        return self.num_layers * per_layer + emb


@dataclass(frozen=True)
class VisionTowerSpec:
    """A ViT: ``family`` ``clip`` (class token, pre-LayerNorm) or ``siglip``."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    patch_size: int = 14
    image_size: int = 336  # the resolution the position table is built for
    attention: str = "flash"  # as TransformerSpec.attention ("unfused": HF's eager attention)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_IMPLS:
            raise ModelSpecError(f"vision attention={self.attention!r} must be one of "
                                 f"{ATTENTION_IMPLS}")
        if self.family not in VISION_FAMILIES:
            raise UnknownModelError(
                f"vision family={self.family!r} is unknown; choose {VISION_FAMILIES}")
        if self.image_size % self.patch_size:
            raise ResolutionError(
                f"vision image_size={self.image_size} is not divisible by patch_size="
                f"{self.patch_size}"
            )

    @property
    def has_cls(self) -> bool:
        return self.family == "clip"

    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# a Llama/Qwen2 decoder layer's Linears as PEFT's ``target_modules`` name them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the text tower (PEFT's ``LoraConfig``): each targeted Linear
    ``d_in -> d_out`` of every decoder layer gains a trainable ``A`` (``rank x d_in``) and
    ``B`` (``d_out x rank``) while the tower's own weights are frozen (no gradients, no
    optimizer state). The default targets are every Linear of the decoder layers but the
    head, what LLaVA's ``find_all_linear_names`` gives (``llava/train/train.py``; its
    ``finetune_lora.sh`` trains rank 128); ``dropout``: PEFT's ``lora_dropout`` (LLaVA 0.05),
    a dropout on each adapter's input that keeps a mask and its output for the backward.
    ``alpha`` only scales the update, so it is no part of the memory. ``base_bits``: 16 (the
    frozen weights in the step's dtype) or 4 (QLoRA: the decoder layers' Linear weights in
    bitsandbytes' nf4 with double quantization, LLaVA's ``--bits 4``)."""

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.05
    base_bits: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ModelSpecError(f"lora rank={self.rank} must be >= 1")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ModelSpecError(f"lora targets={list(self.targets)}: choose from "
                                 f"{LORA_TARGETS}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelSpecError(f"lora dropout={self.dropout} must be in [0, 1)")
        if self.base_bits not in (16, 4):
            raise ModelSpecError(f"lora base_bits={self.base_bits}: choose 16 or 4 "
                                 "(bitsandbytes nf4)")


@dataclass(frozen=True)
class ModelSpec:
    """A model: a text tower, a vision tower, or both joined by a projector. ``family`` (llava |
    qwen-vl | blip2 | llm | vit) groups models for held-out evaluation. ``frozen``: the towers
    trained with frozen weights (of :data:`TOWERS`); ``images_per_sample``: images each
    sample's text interleaves (a multimodal model's input); ``lora``: LoRA adapters on the
    text tower, whose own weights are then frozen (:class:`LoraSpec`)."""

    name: str
    family: str
    vision: VisionTowerSpec | None = None
    text: TransformerSpec | None = None
    projector: str = "mlp2x_gelu"
    num_classes: int = 1000  # ViT classification head (no text tower)
    frozen: tuple[str, ...] = ()
    images_per_sample: int = 1
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        if self.vision is None and self.text is None:
            raise ModelSpecError(f"model {self.name!r} has neither a vision nor a text tower")
        if self.lora is not None and self.text is None:
            raise ModelSpecError(f"model {self.name!r}: lora adapts the text tower, and it has "
                                 "none")
        for tower in self.frozen:
            if tower not in TOWERS:
                raise UnknownModelError(f"frozen tower {tower!r} unknown; choose from {TOWERS}")
        if self.images_per_sample < 0:
            raise ModelSpecError(f"images_per_sample={self.images_per_sample} must be >= 0")
        if self.text is not None and self.vision is not None and (
                self.text.attention != self.vision.attention):
            raise ModelSpecError(f"model {self.name!r}: text attention={self.text.attention!r} "
                                 f"and vision attention={self.vision.attention!r} differ (one "
                                 "attention implementation runs the whole model)")
        if self.projector not in PROJECTORS:
            raise UnknownModelError(f"projector={self.projector!r} unknown; choose {PROJECTORS}")

    @classmethod
    def language_model(cls, text: TransformerSpec, name: str | None = None) -> ModelSpec:
        """A text-only model."""
        return cls(name or f"{text.family}-{text.num_layers}l-h{text.hidden_size}", "llm",
                   text=text)

    @property
    def multimodal(self) -> bool:
        return self.vision is not None and self.text is not None

    @property
    def towers(self) -> tuple[str, ...]:
        """The towers this model has (of :data:`TOWERS`): a vision and a text part joined by
        the projector; the text part alone; or a vision part with its classification head."""
        if self.multimodal:
            return ("vision", "projector", "llm")
        return ("llm",) if self.text is not None else ("vision", "head")

    @property
    def attention(self) -> str:
        """The attention implementation both towers run (one of :data:`ATTENTION_IMPLS`)."""
        return (self.text or self.vision).attention

    @property
    def seq_length(self) -> int | None:
        """Tokens per sample of the text tower, image tokens included (None: no text tower)."""
        return self.text.seq_length if self.text is not None else None

    def with_attention(self, attention: str) -> ModelSpec:
        """The same model with every tower on ``attention``."""
        v = self.vision and replace(self.vision, attention=attention)
        t = self.text and replace(self.text, attention=attention)
        return replace(self, vision=v, text=t)

    def with_seq(self, seq_length: int | None) -> ModelSpec:
        """The same model trained at ``seq_length`` tokens per sample (None: unchanged)."""
        if seq_length is None or self.text is None or seq_length == self.text.seq_length:
            return self
        return replace(self, text=replace(self.text, seq_length=seq_length))

    def at_resolution(self, image_res: int | None) -> ModelSpec:
        """The same model with its vision position table built for ``image_res``."""
        if self.vision is None or image_res is None or image_res == self.vision.image_size:
            return self
        return replace(self, vision=replace(self.vision, image_size=image_res))

    def with_layers(self, vision_layers: int | None, text_layers: int | None) -> ModelSpec:
        v = self.vision and replace(self.vision, num_layers=vision_layers or self.vision.num_layers)
        t = self.text and replace(self.text, num_layers=text_layers or self.text.num_layers)
        return replace(self, vision=v, text=t)

    def pipeline_stage(self, text_layers: int, first: bool, last: bool) -> ModelSpec:
        """What one pipeline stage of this model holds, as Megatron-Core places it
        (``megatron/core/models/gpt/gpt_model.py``, ``pre_process`` / ``post_process``):
        ``text_layers`` text layers, the input embedding (and a multimodal model's vision tower
        and projector, upstream of it) on the ``first`` stage, the final norm, output layer
        and loss on the ``last``."""
        if self.text is None:
            raise ModelSpecError(f"model {self.name!r}: a pipeline stage splits the text tower, "
                                 "and it has none")
        t = replace(self.text, num_layers=text_layers, holds_embedding=first, holds_head=last)
        return replace(self, text=t)
