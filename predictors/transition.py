"""The transition-table predictor: layer l's experts vote for layer l + d's through P(target j | source i), counted
on a training split of the routing (`core.routing_stats.TransitionTable`). It sees only routing, so it runs on any
replayed trace (synthetic, imported logs) where the gate-input predictors cannot.

A token's score for expert j of the target layer is the sum over its source experts i of P(j | i), plus a tiny
share of j's frequency that breaks ties and covers source experts never seen in training.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.routing_stats import TransitionTable
from core.trace import RoutingTrace
from predictors.base import LayerContext
from predictors.common import TrainedPredictor


class TransitionPredictor(TrainedPredictor):
    kind = "transition"

    def __init__(self, name: str, distance: int, counts: np.ndarray, target_freq: np.ndarray, top_k: int):
        """counts: int64 [L, E, E], counts[t, i, j] = tokens with expert i at layer t - distance and j at t;
        target_freq: int64 [L, E] activations per expert at target layer t (rows below `distance` unused)."""
        counts = np.asarray(counts, np.int64)
        super().__init__(name, distance, counts.shape[0], counts.shape[1], top_k)
        self.tables: dict[int, TransitionTable] = {}
        for t in self.targets:
            table = TransitionTable(self.num_experts)
            table.counts, table.target_freq = counts[t].copy(), np.asarray(target_freq[t], np.int64).copy()
            self.tables[t] = table

    @classmethod
    def fit(cls, trace: RoutingTrace, rows: np.ndarray, name: str = "transition",
            distance: int = 1) -> "TransitionPredictor":
        """Count the transitions of `rows` (bool mask or indices) of `trace`, every target layer."""
        L, E = trace.num_layers, trace.meta.num_experts
        sub = trace.select(rows)
        if sub.num_rows == 0:
            raise ValueError(f"{name}: no training rows to count transitions on")
        counts = np.zeros((L, E, E), np.int64)
        freq = np.zeros((L, E), np.int64)
        for t in range(distance, L):
            table = TransitionTable(E).fit(sub.experts[t - distance], sub.experts[t])
            counts[t], freq[t] = table.counts, table.target_freq
        return cls(name, distance, counts, freq, trace.meta.top_k)

    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        return self.tables[target].scores(np.asarray(ctx.experts)).astype(np.float32)

    def layer_arrays(self) -> dict[int, Any]:
        return {t: {"counts": tb.counts.astype(np.float32), "target_freq": tb.target_freq.astype(np.float32)}
                for t, tb in self.tables.items()}
