"""Real training text for CONA: byte-level tokens of the CPython standard-library sources.

Every machine with Python has these files, so tests, the demo and the time-to-perplexity
evaluation train on real code instead of random tokens. Validation is a held-out set of whole
files (chosen by a hash of the path), never windows of the training files.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOD_TOKEN = 256  # end-of-document token appended after every file
VOCAB_SIZE = 257  # 256 byte values + EOD


class DataError(ValueError):
    """The corpus cannot be built (no source files, too little text for one sequence...)."""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """Sorted ``*.py`` files of the standard library, without site-packages and test suites."""
    root = root or stdlib_dir()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not files:
        raise DataError(f"data_path={root}: no *.py files found")
    return sorted(files)


def is_validation_file(path: Path, root: Path, val_fraction: float) -> bool:
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < val_fraction


@dataclass(frozen=True)
class CorpusConfig:
    seq_length: int = 128
    data_path: Path | None = None  # directory of *.py sources; None = this Python's stdlib
    max_train_bytes: int = 8 << 20  # keeps tokenization fast; whole files until the cap
    max_val_bytes: int = 256 << 10
    val_fraction: float = 0.05
    seed: int = 1234


def _tokens(files: list[Path], max_bytes: int) -> np.ndarray:
    chunks: list[np.ndarray] = []
    total = 0
    for path in files:
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int16)
        chunks.append(np.append(data, EOD_TOKEN).astype(np.int16))
        total += data.size + 1
        if total >= max_bytes:
            break
    return np.concatenate(chunks)[:max_bytes] if chunks else np.zeros(0, dtype=np.int16)


class TokenWindows:
    """Fixed ``seq_length + 1`` windows over a token stream, visited in a seeded permutation.

    Sample ``i`` of the infinite stream is window ``perm[i % n]``; the permutation is redrawn
    every epoch from ``seed + epoch`` so every rank derives the same order independently.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, shuffle: bool) -> None:
        self.seq_length = seq_length
        self.num_windows = (tokens.size - 1) // seq_length
        if self.num_windows < 1:
            raise DataError(
                f"seq_length={seq_length}: corpus has only {tokens.size} tokens, fewer than one "
                "sequence"
            )
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seed = seed
        self.shuffle = shuffle
        self._perm_epoch = -1
        self._perm = torch.arange(self.num_windows)

    def __len__(self) -> int:
        return self.num_windows

    def _window(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.num_windows)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1`` as ``[count, seq_length + 1]`` tokens (inputs and
        shifted labels); the runtime's dataset interface."""
        starts = [self._window(start + k) * self.seq_length for k in range(count)]
        return torch.stack([self.tokens[s : s + self.seq_length + 1] for s in starts])


@dataclass
class Corpus:
    train: TokenWindows
    valid: TokenWindows
    vocab_size: int = VOCAB_SIZE


def build_corpus(config: CorpusConfig = CorpusConfig()) -> Corpus:
    root = Path(config.data_path) if config.data_path else stdlib_dir()
    if not root.is_dir():
        raise DataError(f"data_path={root} is not a directory")
    files = source_files(root)
    val = [f for f in files if is_validation_file(f, root, config.val_fraction)]
    train = [f for f in files if not is_validation_file(f, root, config.val_fraction)]
    if not val or not train:
        raise DataError(f"val_fraction={config.val_fraction}: split leaves an empty side")
    return Corpus(
        train=TokenWindows(_tokens(train, config.max_train_bytes), config.seq_length,
                           config.seed, shuffle=True),
        valid=TokenWindows(_tokens(val, config.max_val_bytes), config.seq_length,
                           config.seed, shuffle=False),
    )
