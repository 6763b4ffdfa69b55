"""Scoring predictors on a routing trace: offline (all rows of a layer at once) or prequential
(forward pass by forward pass, each forecast scored and then shown to the predictor, which may
learn online before the next pass — how a serving system would run it).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from core.trace import RoutingTrace
from predictors.base import Predictor, topk_experts
from predictors.data import trace_context
from predictors.metrics import group_means, layer_metrics, per_step_loads

CHUNK = 8192  # rows per predict call offline


def predictor_targets(pred: Predictor, num_layers: int) -> list[int]:
    targets = getattr(pred, "targets", None)
    return list(targets) if targets is not None else list(range(pred.distance, num_layers))


def forecast(pred: Predictor, trace: RoutingTrace, source: int, rows: np.ndarray, top_k: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(top-k forecast int [T, k], scores float32 [T, E]) for trace rows `rows` (indices) of layer `source`."""
    experts, scores = [], []
    for start in range(0, len(rows), CHUNK):
        ctx = trace_context(trace, source, rows[start:start + CHUNK])
        s = np.asarray(pred.predict(ctx), np.float32)
        scores.append(s)
        experts.append(topk_experts(s, top_k))
    E = trace.meta.num_experts
    if not scores:
        return np.zeros((0, top_k), np.int64), np.zeros((0, E), np.float32)
    return np.concatenate(experts), np.concatenate(scores)


def _summarise(per_layer: dict[int, dict[str, float]], groups: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    return {"layers": per_layer, "groups": group_means(per_layer, groups)}


def evaluate_offline(pred: Predictor, trace: RoutingTrace, rows: np.ndarray, groups: Mapping[str, Sequence[int]],
                     n_hot: int = 4, slack: int = 2, loads_out: Optional[dict] = None) -> dict[str, Any]:
    """Per target layer and per layer group, every metric of `predictors.metrics` on the rows `rows` (mask).

    `loads_out`: filled with target layer -> (forecast, true) tokens per expert per step, int [S, E] each.
    """
    idx = np.flatnonzero(rows)
    k, E = trace.meta.top_k, trace.meta.num_experts
    per_layer = {}
    for target in predictor_targets(pred, trace.num_layers):
        predicted, scores = forecast(pred, trace, target - pred.distance, idx, k)
        actual = trace.experts[target, idx].astype(np.int64)
        per_layer[target] = layer_metrics(predicted, actual, trace.step[idx], E, scores, n_hot, slack)
        if loads_out is not None:
            loads_out[target] = (per_step_loads(predicted, trace.step[idx], E), per_step_loads(actual, trace.step[idx], E))
    return _summarise(per_layer, groups)


def evaluate_online(pred: Predictor, trace: RoutingTrace, rows: np.ndarray, groups: Mapping[str, Sequence[int]],
                    n_hot: int = 4, slack: int = 2, progress: Optional[Any] = None) -> dict[str, Any]:
    """Prequential scores: step by step, each layer's forecast is made, scored, then `observe`d."""
    k, E = trace.meta.top_k, trace.meta.num_experts
    targets = predictor_targets(pred, trace.num_layers)
    got: dict[int, dict[str, list[np.ndarray]]] = {t: {"pred": [], "scores": [], "rows": []} for t in targets}
    steps = list(trace.iter_steps())
    scored = "predicted" in inspect.signature(pred.observe).parameters  # observe the exact forecast when it can
    for _, sl in (progress(steps, "online") if progress else steps):
        idx = np.arange(sl.start, sl.stop)[rows[sl]]
        if idx.size == 0:
            continue
        for target in targets:
            ctx = trace_context(trace, target - pred.distance, idx)
            scores = np.asarray(pred.predict(ctx), np.float32)
            predicted = topk_experts(scores, k)
            actual = trace.experts[target, idx].astype(np.int64)
            if scored:
                pred.observe(target, ctx, actual, predicted=predicted)  # type: ignore[call-arg]
            else:
                pred.observe(target, ctx, actual)
            got[target]["pred"].append(predicted)
            got[target]["scores"].append(scores)
            got[target]["rows"].append(idx)
    per_layer = {}
    for target, g in got.items():
        if not g["rows"]:
            continue
        idx = np.concatenate(g["rows"])
        per_layer[target] = layer_metrics(np.concatenate(g["pred"]), trace.experts[target, idx].astype(np.int64),
                                          trace.step[idx], E, np.concatenate(g["scores"]), n_hot, slack)
    return _summarise(per_layer, groups)
