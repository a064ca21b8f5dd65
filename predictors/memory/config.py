"""One GPU's training step as the memory predictor walks it, in the one vocabulary of
:mod:`predictors.spec`: the model (:class:`~predictors.spec.ModelSpec`: its towers, sequence
length, attention, frozen towers, images per sample), the :class:`~predictors.spec.ParallelStrategy`
(micro-batch, data-parallel degree), the :class:`~predictors.spec.TrainingOptions` (ZeRO stage:
distributed optimizer / gradient sharding / FSDP; recompute) and the precision
(:class:`Step`); and the token counts a model and step imply. ``build.py`` turns a model into
real ``transformers`` modules (random init, nothing downloaded)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec.model import TOWERS, ModelSpec, ModelSpecError, ResolutionError
from ..spec.options import DEFAULT_OPTIONS, TrainingOptions
from ..spec.precision import Precision, get_precision
from ..spec.strategy import ParallelStrategy


class ShardingError(ModelSpecError):
    """A ZeRO stage / data-parallel degree combination that cannot shard this model."""


CHECKPOINTING = ("none", "full")  # the recompute modes the memory predictor models
SINGLE_GPU = ParallelStrategy(1, 1, 1)

__all__ = ["CHECKPOINTING", "SINGLE_GPU", "TOWERS", "Shapes", "ShardingError", "Step",
           "resolve_shapes"]


class StrategyView:
    """What the memory side reads off a (strategy, options) pair: one place for both the
    step and the traced path's sharding."""

    strategy: ParallelStrategy
    options: TrainingOptions

    @property
    def dp(self) -> int:
        return self.strategy.dp

    @property
    def zero(self) -> int:
        return self.options.zero_stage


@dataclass(frozen=True)
class Step(StrategyView):
    """What one GPU's training step runs besides the model: the strategy (its micro-batch is
    the step's batch, its ``dp`` what ZeRO shards over), the options and the precision. Only
    ties the three together; every fact lives in its own vocabulary type."""

    strategy: ParallelStrategy = SINGLE_GPU
    options: TrainingOptions = DEFAULT_OPTIONS
    precision: Precision = field(default_factory=lambda: get_precision("bf16"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", get_precision(self.precision))
        if self.options.recompute not in CHECKPOINTING:
            raise ModelSpecError(f"recompute={self.options.recompute!r} is not modelled by the "
                                 f"memory predictor; choose one of {CHECKPOINTING}")

    def __hash__(self) -> int:  # a Precision holds a dict (extra_features): hash its name
        return hash((self.strategy, self.options, self.precision.name))

    @classmethod
    def data_parallel(cls, batch: int, precision: str | Precision, *, recompute: str = "none",
                      zero: int = 0, dp: int = 1) -> Step:
        """``batch`` samples per GPU over ``dp`` ranks at ZeRO stage ``zero``, in plain
        PyTorch (``framework="pytorch"``): the step the ground truth measures
        (``predictors.step``), with no Megatron gradient buffer."""
        return cls(ParallelStrategy(dp, 1, 1, micro_batch=batch),
                   TrainingOptions.for_zero_stage(zero, recompute=recompute,
                                                  framework="pytorch"), precision)

    @property
    def batch(self) -> int:
        return self.strategy.micro_batch

    @property
    def checkpointing(self) -> str:
        return self.options.recompute


@dataclass(frozen=True)
class Shapes:
    """Token counts a (model, step) pair implies."""

    images: int  # images in the step
    patches: int  # patch tokens per image (no CLS)
    vision_tokens: int  # tokens per image inside the ViT (CLS included for CLIP)
    image_tokens: int  # tokens each sample's images contribute to the LLM sequence
    seq: int  # tokens per sample of the text tower (0: no text tower)


def resolve_shapes(model: ModelSpec, step: Step) -> Shapes:
    """Check resolution/sequence consistency and derive token counts (named errors if not)."""
    seq = model.seq_length or 0
    if model.vision is None:
        return Shapes(0, 0, 0, 0, seq)
    v = model.vision
    res = v.image_size
    patches = (res // v.patch_size) ** 2
    per_sample = max(model.images_per_sample, 1)
    images = step.batch * per_sample
    image_tokens = patches * per_sample
    if model.text is not None and image_tokens >= seq:
        raise ResolutionError(
            f"seq={seq} must exceed the {image_tokens} image tokens of "
            f"{per_sample} image(s) at image_res={res}"
        )
    return Shapes(images, patches, patches + int(v.has_cls), image_tokens, seq)
