"""Accuracy of expert forecasts, per layer and per layer group.

- top-k hit rate: share of the true (token, expert) pairs that were forecast (`HitStats`);
- hot Top-n within true Top-(n+slack) (LayerScope Table 4, n=4, slack=2): per forward pass
  (step), the n experts with the most forecast tokens; each counts as correct when the expert's
  true token count is nonzero and at least the (n+slack)-th largest true count;
  accuracy = correct / min(n, experts with tokens), averaged over steps;
- token coverage: per step, the true tokens of the forecast hot n experts over those of the true
  hottest n (1 = the forecast hot set covers as many tokens as the ideal one);
- load Pearson correlation (MoEless Fig. 16): forecast vs true tokens per expert, all (step,
  expert) pairs of a layer pooled (`pearson`), and the mean of the per-step correlations
  (`pearson_step`);
- load accuracy (MoEless Fig. 15): per step, overlap of forecast and true load shares
  (`core.routing_stats.load_accuracy`).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from core.routing_stats import hit_rate, load_accuracy

METRICS = ("hit", "hot", "coverage", "pearson", "pearson_step", "load_acc")


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def per_step_loads(experts: np.ndarray, step: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 [S, E]: tokens per expert in each distinct step (steps in ascending id order). experts: [T, k]."""
    _, g = np.unique(step, return_inverse=True)
    S = int(g.max()) + 1 if g.size else 0
    flat = g[:, None] * num_experts + experts.astype(np.int64)
    return np.bincount(flat.reshape(-1), minlength=S * num_experts).reshape(S, num_experts)


def hot_set(loads: np.ndarray, n: int, tiebreak: Optional[np.ndarray] = None) -> np.ndarray:
    """int [S, n]: per step the n experts with the largest loads (ties by `tiebreak`, then lower id)."""
    key = loads.astype(np.float64)
    if tiebreak is not None:
        tb = np.asarray(tiebreak, np.float64)
        span = np.abs(tb).max(axis=1, keepdims=True)
        key = key + 0.5 * np.divide(tb, span, out=np.zeros_like(tb), where=span > 0)  # < 1 token: ties only
    return np.argsort(-key, axis=1, kind="stable")[:, :n]


def hot_topn_accuracy(pred_loads: np.ndarray, true_loads: np.ndarray, n: int = 4, slack: int = 2,
                      tiebreak: Optional[np.ndarray] = None) -> float:
    """Mean over steps of |hot_n(pred) ∩ true Top-(n+slack)| / min(n, experts with tokens)."""
    S, E = true_loads.shape
    if S == 0:
        return float("nan")
    n = min(n, E)
    hot = hot_set(pred_loads, n, tiebreak)
    m = min(n + slack, E)
    cutoff = -np.sort(-true_loads, axis=1)[:, m - 1:m]  # the (n+slack)-th largest true load
    within = (true_loads > 0) & (true_loads >= cutoff)
    correct = np.take_along_axis(within, hot, axis=1).sum(axis=1)
    active = np.minimum(n, (true_loads > 0).sum(axis=1))
    ok = active > 0
    return float(np.mean(correct[ok] / active[ok])) if ok.any() else float("nan")


def token_coverage(pred_loads: np.ndarray, true_loads: np.ndarray, n: int = 4,
                   tiebreak: Optional[np.ndarray] = None) -> float:
    """Mean over steps of true tokens on the forecast hot n / true tokens on the true hottest n."""
    S, E = true_loads.shape
    if S == 0:
        return float("nan")
    n = min(n, E)
    covered = np.take_along_axis(true_loads, hot_set(pred_loads, n, tiebreak), axis=1).sum(axis=1)
    best = -np.sort(-true_loads, axis=1)[:, :n].sum(axis=1)
    ok = best > 0
    return float(np.mean(covered[ok] / best[ok])) if ok.any() else float("nan")


def load_pearson(pred_loads: np.ndarray, true_loads: np.ndarray) -> float:
    """Pearson correlation of forecast vs true tokens per expert over all (step, expert) pairs."""
    p, t = pred_loads.reshape(-1).astype(np.float64), true_loads.reshape(-1).astype(np.float64)
    if p.size < 2 or p.std() == 0 or t.std() == 0:
        return float("nan")
    return float(np.corrcoef(p, t)[0, 1])


def per_step_pearson(pred_loads: np.ndarray, true_loads: np.ndarray) -> np.ndarray:
    """float64 [S]: per step, Pearson correlation of forecast vs true tokens per expert (NaN if either is constant)."""
    p = pred_loads.astype(np.float64) - pred_loads.mean(axis=1, keepdims=True)
    t = true_loads.astype(np.float64) - true_loads.mean(axis=1, keepdims=True)
    den = np.sqrt((p * p).sum(axis=1) * (t * t).sum(axis=1))
    return np.divide((p * t).sum(axis=1), den, out=np.full(den.shape, np.nan), where=den > 0)


def layer_metrics(predicted: np.ndarray, actual: np.ndarray, step: np.ndarray, num_experts: int,
                  scores: Optional[np.ndarray] = None, n_hot: int = 4, slack: int = 2) -> dict[str, float]:
    """Every metric of one layer. predicted, actual: int [T, k]; step: [T]; scores: optional [T, E] (ties)."""
    pred_loads = per_step_loads(predicted, step, num_experts)
    true_loads = per_step_loads(actual, step, num_experts)
    tiebreak = None
    if scores is not None:
        _, g = np.unique(step, return_inverse=True)
        tiebreak = np.zeros(true_loads.shape, np.float64)
        np.add.at(tiebreak, g, np.asarray(scores, np.float64))
    return {"hit": hit_rate(predicted, actual, num_experts),
            "hot": hot_topn_accuracy(pred_loads, true_loads, n_hot, slack, tiebreak),
            "coverage": token_coverage(pred_loads, true_loads, n_hot, tiebreak),
            "pearson": load_pearson(pred_loads, true_loads),
            "pearson_step": _nanmean(per_step_pearson(pred_loads, true_loads)),
            "load_acc": load_accuracy(predicted, actual, step, num_experts),
            "tokens": int(actual.shape[0]), "steps": int(true_loads.shape[0])}


def mean_over(per_layer: Mapping[int, Mapping[str, float]], layers: Sequence[int]) -> dict[str, float]:
    """Unweighted mean of every metric over `layers` (NaNs skipped); empty dict when no layer is present."""
    rows = [per_layer[l] for l in layers if l in per_layer]
    if not rows:
        return {}
    out = {}
    for key in METRICS:
        out[key] = _nanmean(np.array([r[key] for r in rows], np.float64))
    return out


def group_means(per_layer: Mapping[int, Mapping[str, float]], groups: Mapping[str, Sequence[int]]
                ) -> dict[str, dict[str, float]]:
    """Per layer group (and 'all'), the mean of every metric over its layers."""
    out = {g: mean_over(per_layer, layers) for g, layers in groups.items()}
    out["all"] = mean_over(per_layer, sorted(per_layer))
    return {g: m for g, m in out.items() if m}
