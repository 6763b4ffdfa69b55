"""Historical expert-load forecaster: tomorrow's layer loads look like today's (no model, no hidden states).

Keeps, per MoE layer, an exponential moving average of the *share* of assignments each expert
received, and forecasts a batch's loads as that share times the batch's number of assignments
(T tokens x top-k). `decay = 1` forecasts the last observed step's distribution; before any
observation the forecast is uniform. Serves as the "no load predictor" ablation of MoEless §6.5,
as the forecast of the first `distance` layers (nothing earlier in the pass can predict them), and
as the history EPLB-style policies rebalance from.
"""

from __future__ import annotations

import numpy as np


class HistoricalLoadForecaster:
    """Per-layer EMA of expert load shares."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = 1.0, name: str = "historical"):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"historical load forecaster: decay must lie in (0, 1], got {decay}")
        self.name = name
        self.decay = decay
        self.num_experts = num_experts
        self._share = np.full((num_layers, num_experts), 1.0 / num_experts)
        self._seen = np.zeros(num_layers, dtype=bool)

    def forecast(self, layer: int, num_assignments: float) -> np.ndarray:
        """float64 [E]: expected tokens per expert at MoE layer `layer` for `num_assignments` (T * k)."""
        return self._share[layer] * float(num_assignments)

    def observe(self, layer: int, loads: np.ndarray) -> None:
        """The loads int [E] that MoE layer `layer` actually had."""
        loads = np.asarray(loads, dtype=np.float64)
        total = loads.sum()
        if total <= 0:
            return
        share = loads / total
        if self._seen[layer]:
            self._share[layer] = (1 - self.decay) * self._share[layer] + self.decay * share
        else:
            self._share[layer] = share
            self._seen[layer] = True
