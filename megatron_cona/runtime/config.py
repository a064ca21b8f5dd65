"""What a CONA training run is, independent of its parallel strategy: :class:`TrainConfig`, and
the token dataset interface (:class:`TokenDataset`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from predictors.spec import TransformerSpec
from predictors.spec.precision import get_precision, megatron_precisions

SUPPORTED_PRECISIONS = megatron_precisions()  # entries of the Precision table with a Megatron flag


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a run that does not depend on the parallel strategy."""

    model: TransformerSpec
    precision: str = "fp32"  # one of SUPPORTED_PRECISIONS (names of predictors.spec.precision)
    distributed_optimizer: bool = False
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_samples: int = 0
    lr_decay_samples: int = 1_000_000
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    initial_loss_scale: float = 2.0**16  # fp16 dynamic loss scaling
    dropout: float = 0.0
    init_method_std: float = 0.02
    seed: int = 1234
    ddp_bucket_size: int | None = None  # elements per DDP bucket; None: megatron's default
    # Vocab is padded to a multiple of this times the WORLD size (not TP): every layout of the
    # world then has the same padded embedding shape, so weights move without re-padding.
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        get_precision(self.precision)  # unknown name -> UnknownPrecisionError naming it
        if self.precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not supported by the CONA runtime; use one of "
                f"{', '.join(SUPPORTED_PRECISIONS)}"
            )
        if self.model.family not in ("gpt", "llama"):
            raise ValueError(f"model.family={self.model.family!r}: the runtime builds GPTModel "
                             "(decoder-only: 'gpt' or 'llama')")

    @property
    def params_dtype(self) -> torch.dtype:
        return get_precision(self.precision).param_dtype

    def padded_vocab_size(self, world_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * world_size
        return math.ceil(self.model.vocab_size / multiple) * multiple


class TokenDataset:
    """Fixed-length training samples cut from one 1-D token tensor (sample i starts at i*seq).

    Sample ``i`` is ``seq_length + 1`` tokens (inputs + shifted labels), taken modulo the stream
    length so an epoch wraps around deterministically."""

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_length + 1:
            raise ValueError(f"tokens must be 1-D with >= seq_length+1={seq_length + 1} entries, "
                             f"got shape {tuple(tokens.shape)}")
        self.tokens = tokens.long()
        self.seq_length = seq_length

    def samples(self, start: int, count: int) -> torch.Tensor:
        n, s = self.tokens.numel(), self.seq_length
        offsets = (torch.arange(start, start + count)[:, None] * s + torch.arange(s + 1)) % n
        return self.tokens[offsets]


