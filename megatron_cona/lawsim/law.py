"""The training law the simulator moves on (pure functions and tables, no torch).

State: McCandlish et al. 2018's minimal-steps variable ``S`` (steps at an infinite batch) and
the tokens seen ``D``. A step at global batch ``B`` tokens advances ``S`` by
``1 / (1 + B_crit / B)`` (their Eq 2.11-2.12, learning rate tuned per batch), so over tokens
``dS/dD = 1 / (B + B_crit)``. The loss is Kaplan et al. 2020's
``L(N, S) = (N_c/N)^a_N + (S_c/S)^a_S`` (Eq 1.6). How ``B_crit`` evolves is the registered
:class:`CriticalBatch` form:

* ``loss`` -- Kaplan's ``B_crit(L) = B* / L^(1/a_B)`` (Eq 5.3): the default and the B* x0.5 /
  x2 sensitivity runs;
* ``data`` -- ``B_crit ~ D^0.47`` (Zhang et al. 2024; Bergsma et al. 2025), anchored where the
  paper's batch reaches the compute-optimal data under the ``loss`` form.

Both integrate exactly on fine monotone tables (``S`` for the ``loss`` form, ``D`` for ``data``),
so a chain advancing interval by interval and the exact bound see identical dynamics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron_cona.lawsim.constants import value

GPT2_VOCAB = 50257


class LawError(ValueError):
    """A law setting that cannot be simulated (names the field)."""


def kaplan_floor(nonembedding_params: float) -> float:
    """``(N_c/N)^a_N``: the loss an infinitely long run of this size approaches."""
    if not nonembedding_params > 0:
        raise LawError(f"nonembedding_params={nonembedding_params} must be > 0")
    return (value("N_c") / nonembedding_params) ** value("alpha_N")


def kaplan_loss(nonembedding_params: float, s_min: float) -> float:
    """Kaplan et al. 2020 Eq 1.6 (nats per token, GPT-2 BPE)."""
    return kaplan_floor(nonembedding_params) + (value("S_c") / s_min) ** value("alpha_S")


def kaplan_s_min(nonembedding_params: float, loss: float) -> float:
    """The inverse of :func:`kaplan_loss` in ``S_min``."""
    excess = loss - kaplan_floor(nonembedding_params)
    if excess <= 0:
        raise LawError(f"loss={loss} is at or below the model's floor "
                       f"{kaplan_floor(nonembedding_params):.4f}")
    return value("S_c") / excess ** (1.0 / value("alpha_S"))


def kaplan_bcrit(loss: float, b_star: float) -> float:
    """Kaplan et al. 2020 Eq 5.3 (tokens)."""
    return b_star / loss ** (1.0 / value("alpha_B"))


@dataclass(frozen=True)
class ModelLaw:
    """One model under the law: its non-embedding size (Kaplan's N), B* (tokens) and the scale
    from Kaplan-equivalent loss to the family's reported loss (1 for GPT-style LMs)."""

    name: str
    nonembedding_params: float
    b_star: float
    loss_scale: float = 1.0
    initial_loss: float = math.log(GPT2_VOCAB)  # uniform prediction over Kaplan's vocabulary

    def __post_init__(self) -> None:
        for name in ("nonembedding_params", "b_star", "loss_scale"):
            if not getattr(self, name) > 0:
                raise LawError(f"{name}={getattr(self, name)} must be > 0")
        if self.initial_loss <= kaplan_floor(self.nonembedding_params):
            raise LawError(f"initial_loss={self.initial_loss} is below the loss floor")

    def loss(self, s_min: float) -> float:
        return kaplan_loss(self.nonembedding_params, s_min)

    def s_min(self, loss: float) -> float:
        return kaplan_s_min(self.nonembedding_params, loss)

    @property
    def s0(self) -> float:
        return self.s_min(self.initial_loss)


class CriticalBatch:
    """How B_crit evolves; subclasses integrate ``dS/dD = 1/(B + B_crit)`` exactly."""

    law: ModelLaw

    def b_crit(self, s: float, d: float) -> float:
        """Critical batch in tokens at state (S, D): private to the simulator."""
        raise NotImplementedError

    def advance(self, s: float, d: float, batch: float, tokens: float) -> float:
        """``S`` after ``tokens`` more tokens at global batch ``batch`` tokens."""
        raise NotImplementedError

    def tokens_to(self, s: float, d: float, batch: float, s_goal: float) -> float:
        """Tokens from (S, D) at ``batch`` until ``S`` reaches ``s_goal`` (0 when already)."""
        raise NotImplementedError

    def advance_many(self, s: np.ndarray, d: float, batch: float, tokens: float) -> np.ndarray:
        """:meth:`advance` of many states at the same ``D`` (the exact bound's fronts)."""
        raise NotImplementedError

    def tokens_to_many(self, s: np.ndarray, d: float, batch: float, s_goal: float
                       ) -> np.ndarray:
        """:meth:`tokens_to` of many states at the same ``D``."""
        raise NotImplementedError


def _cumulative(grid: np.ndarray, f: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * np.diff(grid))))


@dataclass
class LossCriticalBatch(CriticalBatch):
    """``B_crit(L) = B* / L^(1/a_B)`` (Kaplan Eq 5.3), ``L`` the Kaplan-equivalent loss. Steps
    from S1 to S2 at batch B: ``(S2 - S1) + (Phi(S2) - Phi(S1)) / B`` with
    ``Phi(S) = int B_crit(L(s)) ds`` (tokens at an infinitesimal batch, McCandlish's E_min)."""

    law: ModelLaw
    b_star: float
    points: int = 40000
    _grid: np.ndarray = field(init=False, repr=False)
    _phi: np.ndarray = field(init=False, repr=False)
    _tables: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.b_star > 0:
            raise LawError(f"b_star={self.b_star} must be > 0")
        self._grid = np.geomspace(self.law.s0, self.law.s0 * 1e9, self.points)
        floor = kaplan_floor(self.law.nonembedding_params)
        loss = floor + (value("S_c") / self._grid) ** value("alpha_S")
        self._phi = _cumulative(self._grid, self.b_star / loss ** (1.0 / value("alpha_B")))

    def b_crit(self, s: float, d: float) -> float:
        return kaplan_bcrit(self.law.loss(s), self.b_star)

    def _table(self, batch: float) -> np.ndarray:
        if batch not in self._tables:  # tokens from s0 at this batch, along the S grid
            self._tables[batch] = batch * (self._grid - self._grid[0]) + self._phi
        return self._tables[batch]

    def _check(self, s: float) -> None:
        if not self._grid[0] <= s <= self._grid[-1]:
            raise LawError(f"S={s} is outside the simulated range "
                           f"[{self._grid[0]:.4g}, {self._grid[-1]:.4g}]")

    def advance(self, s: float, d: float, batch: float, tokens: float) -> float:
        self._check(s)
        return float(self.advance_many(np.asarray(s), d, batch, tokens))

    def advance_many(self, s: np.ndarray, d: float, batch: float, tokens: float) -> np.ndarray:
        t = self._table(batch)
        return np.interp(np.interp(s, self._grid, t) + tokens, t, self._grid)

    def tokens_to(self, s: float, d: float, batch: float, s_goal: float) -> float:
        if s_goal <= s:
            return 0.0
        self._check(s_goal)
        return float(self.tokens_to_many(np.asarray(s), d, batch, s_goal))

    def tokens_to_many(self, s: np.ndarray, d: float, batch: float, s_goal: float
                       ) -> np.ndarray:
        t = self._table(batch)
        return np.maximum(np.interp(s_goal, self._grid, t) - np.interp(s, self._grid, t), 0.0)

    def e_min(self, s1: float, s2: float) -> float:
        """McCandlish's E_min between two states: tokens at an infinitesimal batch."""
        return float(np.interp(s2, self._grid, self._phi) - np.interp(s1, self._grid, self._phi))


@dataclass
class DataCriticalBatch(CriticalBatch):
    """``B_crit(D) = anchor_bcrit * (D / anchor_tokens)^p`` (p = 0.47): growing with the data
    seen whatever the loss. ``S(D2) - S(D1) = G_B(D2) - G_B(D1)``, ``G_B(D) = int dD/(B+B_crit)``,
    independent of S."""

    law: ModelLaw
    anchor_tokens: float
    anchor_bcrit: float
    plateau: float = math.inf  # B_crit stops growing here (tokens)
    points: int = 40000
    _grid: np.ndarray = field(init=False, repr=False)
    _tables: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("anchor_tokens", "anchor_bcrit"):
            if not getattr(self, name) > 0:
                raise LawError(f"{name}={getattr(self, name)} must be > 0")
        self._grid = np.concatenate(([0.0], np.geomspace(1.0, 1e16, self.points)))

    @property
    def exponent(self) -> float:
        return value("crit_batch_data_exponent")

    def b_crit(self, s: float, d: float) -> float:
        return float(self.b_crit_many(np.asarray(d)))

    def b_crit_many(self, d: np.ndarray) -> np.ndarray:
        """:meth:`b_crit` at many token counts (the tables and the bound's relaxation)."""
        return np.minimum(self.plateau, self.anchor_bcrit
                          * (np.maximum(d, 0.0) / self.anchor_tokens) ** self.exponent)

    def _table(self, batch: float) -> np.ndarray:
        if batch not in self._tables:
            self._tables[batch] = _cumulative(self._grid, 1.0 / (batch + self.b_crit_many(
                self._grid)))
        return self._tables[batch]

    def advance(self, s: float, d: float, batch: float, tokens: float) -> float:
        return float(self.advance_many(np.asarray(s), d, batch, tokens))

    def advance_many(self, s: np.ndarray, d: float, batch: float, tokens: float) -> np.ndarray:
        g = self._table(batch)
        return s + float(np.interp(d + tokens, self._grid, g) - np.interp(d, self._grid, g))

    def tokens_to(self, s: float, d: float, batch: float, s_goal: float) -> float:
        if s_goal <= s:
            return 0.0
        return float(self.tokens_to_many(np.asarray(s), d, batch, s_goal))

    def tokens_to_many(self, s: np.ndarray, d: float, batch: float, s_goal: float
                       ) -> np.ndarray:
        g = self._table(batch)
        want = float(np.interp(d, self._grid, g)) + np.maximum(s_goal - s, 0.0)
        out = np.interp(want, g, self._grid) - d
        return np.where(want > g[-1], math.inf, out)


# ------------------------------------------------------------------------ the law variants

LawFactory = Callable[[ModelLaw, Callable[[CriticalBatch], tuple[float, float]]], CriticalBatch]


@dataclass(frozen=True)
class Variant:
    """A registered law: its critical-batch dynamics and how far the probe's noise scale sits
    below the critical batch (``probe_bias`` k: the probe reads ``B_crit / k``)."""

    doc: str
    factory: LawFactory
    probe_bias: float = 1.0


VARIANTS: dict[str, Variant] = {}


def register_variant(name: str, doc: str, factory: LawFactory, probe_bias: float = 1.0) -> None:
    VARIANTS[name] = Variant(doc, factory, probe_bias)


def make_law(variant: str, law: ModelLaw,
             anchor: Callable[[CriticalBatch], tuple[float, float]]) -> CriticalBatch:
    """The critical-batch dynamics of ``variant`` for ``law``; ``anchor(kaplan_dynamics)`` gives
    (tokens, B_crit) where the data form is anchored."""
    if variant not in VARIANTS:
        raise LawError(f"law variant {variant!r} is unknown; choose one of "
                       f"{', '.join(VARIANTS)}")
    return VARIANTS[variant].factory(law, anchor)


def _kaplan(law: ModelLaw, anchor) -> CriticalBatch:
    return LossCriticalBatch(law, law.b_star)


register_variant("kaplan", "B_crit(L) = B*/L^(1/a_B), Kaplan's B*", _kaplan)
register_variant("bstar_x0.5", "Kaplan's form, B* x 0.5",
                 lambda law, anchor: LossCriticalBatch(law, 0.5 * law.b_star))
register_variant("bstar_x2", "Kaplan's form, B* x 2",
                 lambda law, anchor: LossCriticalBatch(law, 2.0 * law.b_star))
for _k in ("noise_scale_bias_lo", "noise_scale_bias_hi"):
    register_variant(f"noise_k{value(_k):g}", f"Kaplan's law, the probe reading B_crit / "
                     f"{value(_k):g} (Merrill et al. 2025's OLMo gap)", _kaplan,
                     probe_bias=value(_k))


def _data_law(law: ModelLaw, anchor) -> CriticalBatch:
    tokens, bcrit = anchor(LossCriticalBatch(law, law.b_star))
    return DataCriticalBatch(law, tokens, bcrit)


register_variant("data_d0.47", "B_crit ~ D^0.47, equal to Kaplan's where the paper's batch "
                 "reaches the compute-optimal data", _data_law)


def _olmo_plateau(law: ModelLaw, anchor) -> CriticalBatch:
    seq = value("olmo_seq")
    return DataCriticalBatch(law, value("olmo_bcrit_anchor_tokens"),
                             value("olmo_bcrit_anchor_docs") * seq,
                             plateau=value("olmo_bcrit_plateau_docs") * seq)


register_variant("plateau", "OLMo-1B's measured B_crit (Merrill et al. 2025): ~D^0.47 through "
                 "2,048 documents at 50B tokens, flat at 4,096 documents", _olmo_plateau)
