"""One vocabulary for every predictor, CONA and the CLIs: the model (:mod:`.model`: a text tower
plus optional vision tower and projector), the parallel strategy (:mod:`.strategy`), the
framework's training options (:mod:`.options`) and the table of precisions (:mod:`.precision`).
Nothing here imports the predictors."""

from .model import (
    ATTENTION_IMPLS,
    LoraSpec,
    ModelSpec,
    ModelSpecError,
    ResolutionError,
    TransformerSpec,
    UnknownModelError,
    VisionTowerSpec,
)
from .options import (
    DEFAULT_OPTIONS,
    FRAMEWORKS,
    RECOMPUTE_MODES,
    TrainingOptions,
    foreach_temporaries,
)
from .strategy import ParallelStrategy, StrategyError

__all__ = ["ATTENTION_IMPLS", "DEFAULT_OPTIONS", "FRAMEWORKS", "RECOMPUTE_MODES", "LoraSpec",
           "ModelSpec", "ModelSpecError", "ParallelStrategy", "ResolutionError", "StrategyError",
           "TrainingOptions", "TransformerSpec", "UnknownModelError", "VisionTowerSpec",
           "foreach_temporaries"]
