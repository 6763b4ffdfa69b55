"""Expert-load forecasts for the serving loop: any `predictors.base.Predictor`, or history.

MoEless §4.1: at MoE layer l a predictor looks at l's gate input (and routing) and forecasts the
expert loads of layer l + d; the scaler and placer then prepare layer l + d while l..l+d-1 run.
A `Predictor` scores experts per token; the load forecast counts each token's top-k forecast
experts (`predictors.base.predicted_loads`). Layers with no layer d before them in the same pass
(l < d), and every layer in the "no predictor" ablation, fall back to the historical forecaster.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from predictors.base import LayerContext, Predictor, predicted_loads
from predictors.historical_load import HistoricalLoadForecaster


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
