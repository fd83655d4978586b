"""A multi-armed-bandit scheduler of global aggregation (CAPT App. A, Eqs. 7–8).

Eq. 7 (value update):   V_{k+1}(a) = V_k(a) + η_k (r_k − V_k(a))
Eq. 8 (selection):      a_k = argmax_a [ V_k(a)/(N_k(a) + ε) + c·sqrt(log Σ_a N_k(a) / (N_k(a) + ε)) ]

The paper leaves the arms, the reward, c, ε and the η schedule unspecified; promptfcl's documented choices:
arms are global-synchronisation periods (in rounds, default {1, 2, 4, 8}); η_k = 1/N_k(a) after the pull
(the sample average — "a decaying learning rate"), or a constant; c = 0.5, ε = 1e-6; an arm never pulled is
pulled first (its bonus is unbounded), in arm order. `value_term: paper` uses Eq. 8 as printed (V/(N + ε));
`mean` uses V alone (standard UCB1). The reward is computed by the caller (CAPT: relative training-loss decrease
per unit of communication during the arm's period).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class BanditScheduler:
    """UCB-style bandit over arms (e.g. sync periods); its state is JSON (`to_dict` / `from_dict`)."""

    arms: list[int]
    c: float = 0.5
    eps: float = 1e-6
    eta: float | None = None  # None: 1/N(a) (sample average); else a constant step size
    value_term: Literal["paper", "mean"] = "paper"
    values: list[float] = field(default_factory=list)
    pulls: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("a bandit needs at least one arm")
        self.values = self.values or [0.0] * len(self.arms)
        self.pulls = self.pulls or [0] * len(self.arms)

    def score(self, a: int) -> float:
        """Eq. 8's objective for arm index a (inf for an arm never pulled)."""
        n = self.pulls[a]
        if n == 0:
            return math.inf
        total = sum(self.pulls)
        value = self.values[a] / (n + self.eps) if self.value_term == "paper" else self.values[a]
        return value + self.c * math.sqrt(math.log(total) / (n + self.eps))

    def select(self) -> int:
        """The arm index to pull next (first maximiser)."""
        scores = [self.score(a) for a in range(len(self.arms))]
        return scores.index(max(scores))

    def update(self, a: int, reward: float) -> None:
        """Eq. 7 after pulling arm index a and observing `reward`."""
        self.pulls[a] += 1
        eta = 1.0 / self.pulls[a] if self.eta is None else self.eta
        self.values[a] += eta * (reward - self.values[a])

    def to_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "pulls": list(self.pulls)}

    def load_dict(self, d: dict[str, Any]) -> None:
        self.values = [float(v) for v in d["values"]]
        self.pulls = [int(n) for n in d["pulls"]]
