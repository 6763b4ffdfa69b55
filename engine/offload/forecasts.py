"""Forecasts for the real executor: the simulator's `ForecastBook`, scored against live routing.

In the simulator the truth comes from the trace being replayed; in the executor it is the routing
the target layer's gate actually produces, known when that gate runs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from engine.sim.predictions import ForecastBook
from predictors.base import LayerContext, Predictor


class LiveForecastBook(ForecastBook):
    """`ForecastBook` whose `settle` takes the target layer's true experts for the pass's tokens.

    Passes of more than `max_tokens` tokens (prefills) are forecast on `max_tokens` evenly spaced
    tokens, the loads scaled up, and scored on those: a forecast runs on the critical path, and a
    trained predictor over a 512-token prompt costs ~10 ms per layer on this machine's CPU, more than
    the prefetches it can steer save (the schedulers only read loads)."""

    def __init__(self, predictors: dict[int, Predictor], top_k: int, num_experts: int, max_tokens: int = 64):
        self.trace = None  # type: ignore[assignment]
        self.predictors = dict(predictors)
        self.k, self.E = top_k, num_experts
        self.max_tokens = max_tokens
        self._pending = {}
        self._current: Optional[LayerContext] = None
        self._picked: dict[int, np.ndarray] = {}  # source layer -> the pass's tokens its context holds
        self.scored: set[int] = set()

    def begin_layer(self, ctx: LayerContext) -> None:
        """The context the next forecasts are made from (the executor builds it from live tensors)."""
        self._current = ctx

    def context(self, layer: int, step: int, rows: Optional[np.ndarray]) -> LayerContext:
        ctx = self._current
        assert ctx is not None and ctx.layer == layer, "begin_layer() not called"
        T = ctx.experts.shape[0]
        if T <= self.max_tokens:
            self._picked.pop(layer, None)
            return ctx
        picked = np.unique(np.linspace(0, T - 1, self.max_tokens).round().astype(np.int64))
        self._picked[layer] = picked
        values = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
        return LayerContext(**{name: v[picked] if isinstance(v, np.ndarray) else v for name, v in values.items()})

    def forecast(self, ctx: LayerContext, distance: int, num_tokens: Optional[int] = None) -> np.ndarray:
        """The loads of the whole pass (a sampled context's scaled up to the pass's tokens)."""
        assert self._current is not None and self._current.layer == ctx.layer
        return super().forecast(ctx, distance, num_tokens=self._current.experts.shape[0])

    def settle_live(self, layer: int, actual: np.ndarray) -> None:
        """Score every forecast made for `layer` against `actual` int [T, k] (the pass's T tokens)."""
        for pred, ctx, experts in self._pending.pop(layer, []):
            self.scored.add(layer - ctx.layer)
            picked = self._picked.get(ctx.layer)
            truth = actual if picked is None else actual[picked]
            try:
                pred.observe(layer, ctx, truth, predicted=experts)  # type: ignore[call-arg]
            except TypeError:
                pred.observe(layer, ctx, truth)
