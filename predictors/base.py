"""The predictor contract shared by the simulator, the offload executor and the serving loop.

A predictor looks at MoE layer `l` (its gate input, its routing, the tokens) and scores the experts
of MoE layer `l + distance` for every token. Layers are counted in MoE-layer indices (0 = first
MoE layer), not decoder-layer indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from core.routing_stats import topk_experts


@dataclass
class LayerContext:
    """What a predictor may see at MoE layer `layer` of forward pass `step` (T real tokens)."""

    layer: int
    step: int
    experts: np.ndarray  # int [T, k]: experts chosen at `layer`
    weights: np.ndarray  # float32 [T, k]: their routing weights
    hidden: Optional[np.ndarray] = None  # float32 [T, H]: gate input at `layer`
    tokens: Optional[np.ndarray] = None  # int [T]: token ids
    seq: Optional[np.ndarray] = None  # int [T]: sequence ids (trace rows)
    pos: Optional[np.ndarray] = None  # int [T]: positions
    rows: Optional[np.ndarray] = None  # int [T]: row indices into a RoutingTrace, where replaying one


@dataclass
class HitStats:
    """Running hit / miss counts of a predictor's top-k forecasts, per target layer."""

    hits: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)

    def record(self, layer: int, predicted: np.ndarray, actual: np.ndarray) -> None:
        """`predicted`, `actual`: int [T, k] expert ids for the same tokens."""
        hit = sum(len(set(p.tolist()) & set(a.tolist())) for p, a in zip(predicted, actual))
        self.hits[layer] = self.hits.get(layer, 0) + int(hit)
        self.total[layer] = self.total.get(layer, 0) + int(actual.size)

    def hit_rate(self, layer: Optional[int] = None) -> float:
        """Fraction of true (token, expert) pairs that were predicted; 1.0 before any evidence."""
        if layer is None:
            tot = sum(self.total.values())
            return sum(self.hits.values()) / tot if tot else 1.0
        tot = self.total.get(layer, 0)
        return self.hits.get(layer, 0) / tot if tot else 1.0


@runtime_checkable
class Predictor(Protocol):
    name: str
    distance: int  # predicts MoE layer `ctx.layer + distance`

    def predict(self, ctx: LayerContext) -> np.ndarray:
        """Scores float32 [T, E] for the experts of MoE layer `ctx.layer + self.distance`."""
        ...

    def observe(self, target_layer: int, ctx: LayerContext, actual_experts: np.ndarray) -> None:
        """The true routing int [T, k] of `target_layer` for the tokens of `ctx` (online update, stats)."""
        ...

    def hit_rate(self, target_layer: Optional[int] = None) -> float:
        """Measured top-k hit rate so far (PreSched eq. 6 uses it as R_hit)."""
        ...


def predicted_loads(scores: np.ndarray, k: int) -> np.ndarray:
    """int64 [E]: tokens per expert if every token took its top-k predicted experts."""
    experts = topk_experts(scores, k)
    return np.bincount(experts.reshape(-1), minlength=scores.shape[1]).astype(np.int64)
