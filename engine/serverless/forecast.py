"""Expert-load forecasts for the serving loop: any `predictors.base.Predictor`, or history.

MoEless §4.1: at MoE layer l a predictor looks at l's gate input (and routing) and forecasts the
expert loads of layer l + d; the scaler and placer then prepare layer l + d while l..l+d-1 run.
A `Predictor` scores experts per token; the load forecast counts each token's top-k forecast
experts (`predictors.base.predicted_loads`). Layers with no layer d before them in the same pass
(l < d), and every layer in the "no predictor" ablation, fall back to the historical forecaster.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import numpy as np

from predictors.base import HitStats, LayerContext, Predictor, predicted_loads, topk_experts
from predictors.historical_load import HistoricalLoadForecaster
from predictors.oracle import count_hits


class LoadForecast:
    """Forecast loads of MoE layer `ctx.layer + distance` from a per-token predictor, history otherwise."""

    def __init__(self, predictor: Optional[Predictor], history: HistoricalLoadForecaster, top_k: int):
        self.predictor = predictor
        self.history = history
        self.top_k = top_k

    @property
    def distance(self) -> int:
        return self.predictor.distance if self.predictor is not None else 0

    def from_predictor(self, ctx: LayerContext) -> np.ndarray:
        """float64 [E]: the predictor's forecast for layer ctx.layer + distance (tokens of ctx)."""
        if self.predictor is None:
            raise ValueError("load forecast: no predictor configured")
        scores = self.predictor.predict(ctx)
        return predicted_loads(scores, self.top_k).astype(np.float64)

    def from_history(self, layer: int, num_tokens: int) -> np.ndarray:
        """float64 [E]: historical shares of `layer` times the assignments of `num_tokens` tokens."""
        return self.history.forecast(layer, num_tokens * self.top_k)


class TiledPredictor:
    """A predictor of a recorded model's R MoE layers, run on a deeper simulated model whose layers
    cycle through the recorded ones (`engine.sim.routing.tile_layers`: simulated layer l replays
    recorded layer l mod R).

    A forecast from simulated layer l to l + d is the recorded model's own pair (l mod R) -> (l mod R)
    + d when that pair lies inside one cycle (`covers`); across a cycle's end there is no such pair in
    the recorded model, and the simulator falls back to history there, as for the first d layers.
    The gate inputs come from the recorded trace (`hidden` [R, N, H], rows aligned with the replayed
    trace's), since the cycled trace does not copy them. Hit rates are kept per simulated target layer.
    """

    def __init__(self, inner: Predictor, recorded_layers: int, hidden: Optional[np.ndarray] = None):
        if not 1 <= inner.distance < recorded_layers:
            raise ValueError(f"tiled predictor: distance {inner.distance} needs 1 <= d < {recorded_layers} recorded layers")
        self.inner = inner
        self.recorded_layers = recorded_layers
        self.hidden = hidden
        self.name = inner.name
        self.distance = inner.distance
        self.stats = HitStats()

    def covers(self, source_layer: int) -> bool:
        """Whether simulated layer `source_layer` + d maps to a pair of the recorded model."""
        return source_layer % self.recorded_layers + self.distance < self.recorded_layers

    def _recorded(self, ctx: LayerContext) -> LayerContext:
        if not self.covers(ctx.layer):
            raise ValueError(f"tiled predictor: simulated layer {ctx.layer} + {self.distance} crosses the end of the "
                             f"{self.recorded_layers} recorded layers (no model pair; forecast from history)")
        source = ctx.layer % self.recorded_layers
        hidden = ctx.hidden
        if self.hidden is not None:
            if ctx.rows is None:
                raise ValueError("tiled predictor: the context has no trace rows to read gate inputs from")
            hidden = self.hidden[source, ctx.rows]
        return dataclasses.replace(ctx, layer=source, hidden=hidden)

    def predict(self, ctx: LayerContext) -> np.ndarray:
        return self.inner.predict(self._recorded(ctx))

    def observe(self, target_layer: int, ctx: LayerContext, actual_experts: np.ndarray,
                predicted: Optional[np.ndarray] = None) -> None:
        if predicted is None:
            predicted = topk_experts(self.predict(ctx), actual_experts.shape[1])
        actual_experts = np.asarray(actual_experts)
        recorded = self._recorded(ctx)  # the inner predictor scores (and, if online, learns) in its own layers
        if "predicted" in inspect.signature(self.inner.observe).parameters:
            self.inner.observe(recorded.layer + self.distance, recorded, actual_experts, predicted=predicted)
        else:
            self.inner.observe(recorded.layer + self.distance, recorded, actual_experts)
        self.stats.hits[target_layer] = self.stats.hits.get(target_layer, 0) + count_hits(predicted, actual_experts)
        self.stats.total[target_layer] = self.stats.total.get(target_layer, 0) + int(actual_experts.size)

    def hit_rate(self, target_layer: Optional[int] = None) -> float:
        return self.stats.hit_rate(target_layer)
