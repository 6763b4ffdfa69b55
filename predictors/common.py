"""What every trained predictor shares: target-layer checks, top-k forecasts, hit statistics, footprint.

Concrete predictors implement `scores(target, ctx) -> float32 [T, E]`, `layer_arrays()` (what is
saved and what the footprint counts) and, where they learn online, `learn(...)`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from predictors.base import HitStats, LayerContext, topk_experts
from predictors.oracle import count_hits


def row_bucket(n: int, minimum: int = 16) -> int:
    """Rows a forecast batch is padded to (a power of two): few compiled shapes whatever the batch."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """`a` [T, ...] zero-padded to `rows` rows."""
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[: a.shape[0]] = a
    return out


class TrainedPredictor:
    """Base of the stats / gate / token / LLaPor / MoEless predictors (`predictors.base.Predictor`)."""

    kind: str = ""

    def __init__(self, name: str, distance: int, num_layers: int, num_experts: int, top_k: int):
        if distance < 1:
            raise ValueError(f"{self.kind} predictor: distance must be >= 1, got {distance}")
        if distance >= num_layers:
            raise ValueError(f"{self.kind} predictor: distance {distance} leaves no target among {num_layers} MoE layers")
        self.name = name
        self.distance = distance
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.stats = HitStats()
        self.prior_hit: dict[int, float] = {}  # hit rate per target layer measured offline (held-out test)

    # ---- contract -----------------------------------------------------------------------------------------
    @property
    def targets(self) -> list[int]:
        """The MoE layers this predictor forecasts (layer 0 .. distance - 1 have no source layer)."""
        return list(range(self.distance, self.num_layers))

    def target_of(self, ctx: LayerContext) -> int:
        target = ctx.layer + self.distance
        if not self.distance <= target < self.num_layers:
            raise ValueError(f"{self.name}: source layer {ctx.layer} + distance {self.distance} is not a target "
                             f"layer in [{self.distance}, {self.num_layers})")
        return target

    def predict(self, ctx: LayerContext) -> np.ndarray:
        """float32 [T, E] scores for the experts of MoE layer `ctx.layer + distance`."""
        return self.scores(self.target_of(ctx), ctx)

    def predict_topk(self, ctx: LayerContext) -> np.ndarray:
        """int [T, k]: the forecast experts of the target layer, best first."""
        return topk_experts(self.predict(ctx), self.top_k)

    def observe(self, target_layer: int, ctx: LayerContext, actual_experts: np.ndarray,
                predicted: Optional[np.ndarray] = None) -> None:
        """Score the forecast (`predicted` [T, k], or a fresh one) and let the predictor learn online."""
        if predicted is None:
            predicted = self.predict_topk(ctx)
        actual_experts = np.asarray(actual_experts)
        hits = count_hits(predicted, actual_experts)
        self.stats.hits[target_layer] = self.stats.hits.get(target_layer, 0) + hits
        self.stats.total[target_layer] = self.stats.total.get(target_layer, 0) + int(actual_experts.size)
        self.learn(target_layer, ctx, actual_experts, predicted)

    def hit_rate(self, target_layer: Optional[int] = None) -> float:
        """Measured top-k hit rate: at run time once forecasts were scored, else the offline test figure
        saved with the predictor, else 1.0 (no evidence)."""
        seen = self.stats.total.get(target_layer, 0) if target_layer is not None else sum(self.stats.total.values())
        if seen:
            return self.stats.hit_rate(target_layer)
        if target_layer is None and self.prior_hit:
            return float(np.mean(list(self.prior_hit.values())))
        return self.prior_hit.get(target_layer, 1.0) if target_layer is not None else 1.0

    # ---- for subclasses -------------------------------------------------------------------------------------
    def scores(self, target: int, ctx: LayerContext) -> np.ndarray:
        raise NotImplementedError

    def learn(self, target: int, ctx: LayerContext, actual: np.ndarray, predicted: np.ndarray) -> None:
        """Online update from the true routing of `target` (default: none)."""

    def warm_up(self) -> None:
        """Compile now what online learning would compile at its first update (default: nothing); executors
        call it before serving, so no timed step pays a compilation."""

    def layer_arrays(self) -> dict[int, Any]:
        """Per target layer, the pytree of arrays this predictor keeps for it (saved, counted as footprint)."""
        raise NotImplementedError

    def shared_arrays(self) -> Any:
        """Arrays shared by every layer (e.g. an embedding table); None when there are none."""
        return None

    def memory_mb(self) -> dict[int, float]:
        """Per target layer, the predictor's parameter memory in MB (float32 as kept in memory)."""
        from predictors.nets import param_bytes  # why lazy: nets brings jax; the routing-only predictors run without

        return {t: param_bytes(a) / 2**20 for t, a in self.layer_arrays().items()}

    def require_hidden(self, ctx: LayerContext) -> np.ndarray:
        if ctx.hidden is None:
            raise ValueError(f"{self.name}: LayerContext.hidden (the gate input of MoE layer {ctx.layer}) is required; "
                             "replay a trace recorded with keep_hidden (predictors.data.trace_context)")
        return np.asarray(ctx.hidden, np.float32)
