"""The statistics-based predictor (MoE-Infinity / Klotski style hot experts): every token of a layer is
forecast to use that layer's most frequent experts in the training data.

Scores are the experts' activation frequencies at the target layer, the same for every token;
with `online`, observed routing keeps adding to the counts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.trace import RoutingTrace
from predictors.base import LayerContext
from predictors.common import TrainedPredictor


class StatsPredictor(TrainedPredictor):
    kind = "stats"

    def __init__(self, name: str, distance: int, counts: np.ndarray, top_k: int, online: bool = False):
        """counts: float64 [L, E] activations per expert at every MoE layer."""
        counts = np.asarray(counts, np.float64)
        super().__init__(name, distance, counts.shape[0], counts.shape[1], top_k)
        self.counts = counts
        self.online = online

    @classmethod
    def fit(cls, trace: RoutingTrace, rows: np.ndarray, name: str = "stats", distance: int = 1,
            online: bool = False) -> "StatsPredictor":
        counts = trace.select(rows).expert_loads().astype(np.float64)
        return cls(name, distance, counts, trace.meta.top_k, online)

    def frequencies(self, target: int) -> np.ndarray:
        """float64 [E]: share of the target layer's activations per expert (uniform before any count)."""
        c = self.counts[target]
        total = c.sum()
        return c / total if total > 0 else np.full_like(c, 1.0 / c.shape[0])

    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        freq = self.frequencies(target).astype(np.float32)
        return np.broadcast_to(freq, (ctx.experts.shape[0], self.num_experts)).copy()

    def learn(self, target: int, ctx: LayerContext, actual: np.ndarray, predicted: np.ndarray) -> None:
        if self.online:
            self.counts[target] += np.bincount(actual.reshape(-1).astype(np.int64), minlength=self.num_experts)

    def layer_arrays(self) -> dict[int, Any]:
        return {t: {"counts": self.counts[t].astype(np.float32)} for t in self.targets}
