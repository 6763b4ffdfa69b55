"""Forecasts of both offload mechanisms: lazily asked predictors, scored once the truth is known.

A scheduler reads `state.predicted[target]` (predicted tokens per expert of MoE layer `target`);
only then is the predictor for distance `target - layer` run, so policies that never look ahead cost
nothing. Every forecast made is scored against the true routing when the target layer's gate runs
(`Predictor.observe`), which is what the measured hit rate of PreSched eq. 6 is built from. In the
simulator (`ForecastBook`) the truth comes from the trace being replayed; in the real executor
(`LiveForecastBook`) it is the routing the target layer's gate actually produces, known when that
gate runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Iterator, Optional

import numpy as np

from core.trace import RoutingTrace
from predictors.base import LayerContext, Predictor, topk_experts


class ForecastBook:
    """The predictors of one run (by distance) and the forecasts awaiting their truth.

    Passes of more than `max_tokens` tokens (long prefills) are forecast on a uniform sample of
    `max_tokens` of their tokens, the predicted loads scaled up: the schedulers only read loads, and
    a prefill's experts are almost all active anyway.
    """

    def __init__(self, trace: RoutingTrace, predictors: dict[int, Predictor], max_tokens: int = 2048, seed: int = 0):
        self.trace = trace
        self.predictors = dict(predictors)
        self.k = trace.meta.top_k
        self.E = trace.meta.num_experts
        self.max_tokens = max_tokens
        self._rng = np.random.default_rng(seed)
        self._sample: dict[int, np.ndarray] = {}
        self._pending: dict[int, list[tuple[Predictor, LayerContext, np.ndarray]]] = {}
        self.scored: set[int] = set()  # distances with at least one forecast scored

    @property
    def max_distance(self) -> int:
        return max(self.predictors, default=0)

    def context(self, layer: int, step: int, rows: np.ndarray) -> LayerContext:
        if rows.size > self.max_tokens:  # one sample per pass, shared by its layers
            if step not in self._sample:
                self._sample = {step: np.sort(self._rng.choice(rows, self.max_tokens, replace=False))}
            rows = self._sample[step]
        hidden = None if self.trace.hidden is None else self.trace.hidden[layer, rows].astype(np.float32)
        return LayerContext(layer=layer, step=step, experts=self.trace.experts[layer, rows],
                            weights=self.trace.weights[layer, rows], hidden=hidden, tokens=self.trace.token[rows],
                            seq=self.trace.seq[rows], pos=self.trace.pos[rows], rows=rows)

    def forecast(self, ctx: LayerContext, distance: int, num_tokens: Optional[int] = None) -> np.ndarray:
        """float64 [E]: predicted tokens per expert of layer `ctx.layer + distance` (scaled to
        `num_tokens` when `ctx` holds a sample of the pass)."""
        pred = self.predictors[distance]
        topk = getattr(pred, "predict_topk", None)
        experts = topk(ctx) if topk is not None else topk_experts(pred.predict(ctx), self.k)
        self._pending.setdefault(ctx.layer + distance, []).append((pred, ctx, experts))
        loads = np.bincount(experts.reshape(-1), minlength=self.E).astype(np.float64)
        if num_tokens is not None and num_tokens > experts.shape[0] > 0:
            loads *= num_tokens / experts.shape[0]
        return loads

    def settle(self, layer: int, rows: np.ndarray) -> None:
        """Score every forecast made for `layer` against its true routing (called at its gate)."""
        for pred, ctx, experts in self._pending.pop(layer, []):
            actual = self.trace.experts[layer, ctx.rows]
            self.scored.add(layer - ctx.layer)
            try:
                pred.observe(layer, ctx, actual, predicted=experts)  # type: ignore[call-arg]
            except TypeError:
                pred.observe(layer, ctx, actual)

    def discard(self, layer: int) -> None:
        """Forget the forecasts made for `layer` unscored (its gate ran on other tokens than they were made for)."""
        self._pending.pop(layer, None)

    def drop_pending(self) -> None:
        """Forget forecasts whose target never ran (the end of a forward pass)."""
        self._pending.clear()

    def hit_rates(self) -> dict[int, float]:
        """R_hit per distance for the schedulers (a predictor's prior before any evidence)."""
        return {d: float(p.hit_rate()) for d, p in self.predictors.items()}

    def measured_hit_rates(self) -> dict[int, float]:
        """Hit rates of the distances whose forecasts were scored in this run (what results report)."""
        return {d: r for d, r in self.hit_rates().items() if d in self.scored}


class LazyForecasts(Mapping):
    """`LayerState.predicted` of one layer: target layer -> predicted loads, computed on first access."""

    def __init__(self, book: ForecastBook, layer: int, step: int, rows: np.ndarray, num_layers: int):
        self._book, self._layer, self._step, self._rows = book, layer, step, rows
        self._targets = [layer + d for d in sorted(book.predictors) if layer + d < num_layers]
        self._ctx: Optional[LayerContext] = None
        self._cache: dict[int, np.ndarray] = {}

    def __getitem__(self, target: int) -> np.ndarray:
        if target not in self._targets:
            raise KeyError(target)
        if target not in self._cache:
            if self._ctx is None:
                self._ctx = self._book.context(self._layer, self._step, self._rows)
            n = None if self._rows is None else int(self._rows.size)
            self._cache[target] = self._book.forecast(self._ctx, target - self._layer, num_tokens=n)
        return self._cache[target]

    def __iter__(self) -> Iterator[int]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __contains__(self, target: object) -> bool:
        return target in self._targets


class LiveForecastBook(ForecastBook):
    """`ForecastBook` whose `settle` takes the target layer's true experts for the pass's tokens.

    Passes of more than `max_tokens` tokens (prefills) are forecast on `max_tokens` evenly spaced
    tokens, the loads scaled up, and scored on those: a forecast runs on the critical path, and a
    trained predictor over a whole long prompt costs more per layer on a CPU than the prefetches it can
    steer save (the schedulers only read loads)."""

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
