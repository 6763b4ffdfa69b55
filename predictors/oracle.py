"""The (noisy) oracle predictor: the true routing of the target layer, read from a routing trace.

With `hit_rate = 1` it is the perfect predictor; below 1, each true (token, expert) pair is kept
with probability `hit_rate` and otherwise replaced by an expert the token does not use, so the
expected top-k hit rate is exactly `hit_rate` (a stand-in for LLaPor's measured accuracy, Table 4).
Tokens are located by `LayerContext.rows` (row indices into the trace).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from core.trace import RoutingTrace
from predictors.base import HitStats, LayerContext


def count_hits(predicted: np.ndarray, actual: np.ndarray) -> int:
    """Number of true (token, expert) pairs in `actual` [T, k] that `predicted` [T, k'] names too."""
    if actual.size == 0:
        return 0
    width = int(max(predicted.max(initial=0), actual.max(initial=0))) + 1
    named = np.zeros((actual.shape[0], width), dtype=bool)
    named[np.arange(predicted.shape[0])[:, None], predicted] = True
    return int(named[np.arange(actual.shape[0])[:, None], actual].sum())


class NoisyOraclePredictor:
    """`predictors.base.Predictor` whose forecasts come from the trace being replayed."""

    def __init__(self, trace: RoutingTrace, distance: int = 1, hit_rate: float = 1.0, seed: int = 0,
                 name: Optional[str] = None):
        if distance < 1:
            raise ValueError(f"oracle predictor: distance must be >= 1, got {distance}")
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"oracle predictor: hit_rate must lie in [0, 1], got {hit_rate}")
        self.trace = trace
        self.distance = distance
        self.target_hit_rate = hit_rate
        self.name = name or ("oracle" if hit_rate == 1.0 else f"oracle@{hit_rate:g}")
        self.num_experts = trace.meta.num_experts
        self.top_k = trace.meta.top_k
        self.stats = HitStats()
        self._rng = np.random.default_rng(seed)
        self._sum_hits = self._sum_total = 0  # running totals behind hit_rate() (asked at every layer)

    def predict_topk(self, ctx: LayerContext) -> np.ndarray:
        """int [T, k]: the forecast experts of MoE layer `ctx.layer + distance` for the tokens of `ctx`."""
        target = ctx.layer + self.distance
        if ctx.rows is None:
            raise ValueError("oracle predictor: LayerContext.rows (trace row indices) is required")
        if not 0 <= target < self.trace.num_layers:
            raise ValueError(f"oracle predictor: target layer {target} outside [0, {self.trace.num_layers})")
        true = self.trace.experts[target, ctx.rows].astype(np.int64)  # [T, k]
        if self.target_hit_rate >= 1.0 or true.size == 0:
            return true
        miss = self._rng.random(true.shape) >= self.target_hit_rate
        if not miss.any():
            return true
        # a wrong expert per miss: uniform over the experts neither true for the token nor forecast
        # for it in another slot (rejection sampling over all misses at once)
        rows, cols = np.nonzero(miss)
        wrong = self._rng.integers(0, self.num_experts, size=rows.size)
        redo = np.ones(rows.size, dtype=bool)
        while redo.any():
            wrong[redo] = self._rng.integers(0, self.num_experts, size=int(redo.sum()))
            redo = (wrong[:, None] == true[rows]).any(axis=1)
            key = rows * self.num_experts + wrong  # same token, same wrong expert: keep the first
            order = np.argsort(key, kind="stable")
            again = np.zeros(rows.size, dtype=bool)
            again[order[1:]] = key[order[1:]] == key[order[:-1]]
            redo |= again
        out = true.copy()
        out[rows, cols] = wrong
        return out

    def predict(self, ctx: LayerContext) -> np.ndarray:
        """float32 [T, E]: 1 on the forecast experts (best first: 1, 1 - 1/2k, ...), 0 elsewhere."""
        experts = self.predict_topk(ctx)
        scores = np.zeros((experts.shape[0], self.num_experts), dtype=np.float32)
        rank_score = 1.0 - np.arange(experts.shape[1], dtype=np.float32) / (2 * experts.shape[1])
        np.put_along_axis(scores, experts, rank_score[None, :], axis=1)
        return scores

    def observe(self, target_layer: int, ctx: LayerContext, actual_experts: np.ndarray,
                predicted: Optional[np.ndarray] = None) -> None:
        """Record the hit rate of a forecast (pass `predicted` [T, k] to score that exact forecast)."""
        if predicted is None:
            predicted = self.predict_topk(ctx)
        hits, total = count_hits(predicted, actual_experts), int(actual_experts.size)
        self.stats.hits[target_layer] = self.stats.hits.get(target_layer, 0) + hits
        self.stats.total[target_layer] = self.stats.total.get(target_layer, 0) + total
        self._sum_hits += hits
        self._sum_total += total

    def hit_rate(self, target_layer: Optional[int] = None) -> float:
        if target_layer is None:
            return self._sum_hits / self._sum_total if self._sum_total else 1.0
        return self.stats.hit_rate(target_layer)
