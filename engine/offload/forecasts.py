"""Forecasts for the real executor: the simulator's `ForecastBook`, scored against live routing.

In the simulator the truth comes from the trace being replayed; in the executor it is the routing
the target layer's gate actually produces, known when that gate runs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from engine.sim.predictions import ForecastBook
from predictors.base import LayerContext, Predictor


class LiveForecastBook(ForecastBook):
    """`ForecastBook` whose `settle` takes the target layer's true experts for the pass's tokens."""

    def __init__(self, predictors: dict[int, Predictor], top_k: int, num_experts: int):
        self.trace = None  # type: ignore[assignment]
        self.predictors = dict(predictors)
        self.k, self.E = top_k, num_experts
        self._pending = {}
        self._current: Optional[LayerContext] = None
        self.scored: set[int] = set()

    def begin_layer(self, ctx: LayerContext) -> None:
        """The context the next forecasts are made from (the executor builds it from live tensors)."""
        self._current = ctx

    def context(self, layer: int, step: int, rows: Optional[np.ndarray]) -> LayerContext:
        assert self._current is not None and self._current.layer == layer, "begin_layer() not called"
        return self._current

    def settle_live(self, layer: int, actual: np.ndarray) -> None:
        """Score every forecast made for `layer` against `actual` int [T, k] (the same T tokens)."""
        for pred, ctx, experts in self._pending.pop(layer, []):
            self.scored.add(layer - ctx.layer)
            try:
                pred.observe(layer, ctx, actual, predicted=experts)  # type: ignore[call-arg]
            except TypeError:
                pred.observe(layer, ctx, actual)
