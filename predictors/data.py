"""Predictor datasets from routing traces: per source layer l the tuple (a, e_i, w_i) and the experts
of layer l + d as targets, split by sequence (never by token).

Layers are MoE-layer indices. A predictor "for target layer j" reads layer j - d.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from core.routing_stats import expert_mask, split_by_sequence
from core.trace import RoutingTrace
from predictors.base import LayerContext


@dataclass(frozen=True)
class Split:
    """Boolean row masks over one trace: disjoint sets of whole sequences."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def split_rows(trace: RoutingTrace, test_fraction: float, val_fraction: float = 0.0, seed: int = 0) -> Split:
    """Hold out `test_fraction` of the sequences for test, then `val_fraction` of the rest for validation."""
    train, test = split_by_sequence(trace, test_fraction, seed)
    val = np.zeros_like(train)
    if val_fraction > 0:
        sub = trace.select(train)
        sub_train, sub_val = split_by_sequence(sub, val_fraction, seed + 1)
        val[np.flatnonzero(train)[sub_val]] = True
        train = train & ~val
    return Split(train=train, val=val, test=test)


def routing_vector(experts: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [T, E]: each token's routing weights scattered onto its experts (0 elsewhere)."""
    out = np.zeros((experts.shape[0], num_experts), np.float32)
    np.put_along_axis(out, experts.astype(np.int64), weights.astype(np.float32), axis=1)
    return out


def multi_hot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [T, E]: 1 where the token chose the expert."""
    return expert_mask(experts, num_experts).astype(np.float32)


@dataclass(frozen=True)
class LayerPairs:
    """Rows of one (source layer, distance) pair: what a predictor sees and what it must predict."""

    source: int
    distance: int
    experts: np.ndarray  # int [T, k]: source-layer experts
    weights: np.ndarray  # float32 [T, k]
    hidden: Optional[np.ndarray]  # float32 [T, H]: source-layer gate input
    tokens: np.ndarray  # int [T]
    step: np.ndarray  # int [T]
    target: np.ndarray  # int [T, k]: target-layer experts
    target_weights: np.ndarray  # float32 [T, k]

    @property
    def num_rows(self) -> int:
        return int(self.experts.shape[0])


def layer_pairs(trace: RoutingTrace, source: int, distance: int, rows: np.ndarray | slice | None = None,
                with_hidden: bool = True) -> LayerPairs:
    """The rows `rows` (a mask, indices or slice; all by default) of source layer `source`."""
    L = trace.num_layers
    if not 0 <= source < L or not 0 <= source + distance < L:
        raise ValueError(f"layer pairs: source {source} + distance {distance} outside the {L} MoE layers")
    sel = slice(None) if rows is None else rows
    hidden = None
    if with_hidden:
        if trace.hidden is None:
            raise ValueError(f"trace of {trace.meta.model}: no hidden states (record it with keep_hidden=true)")
        hidden = trace.hidden[source, sel].astype(np.float32)
    return LayerPairs(source=source, distance=distance, experts=trace.experts[source, sel].astype(np.int64),
                      weights=trace.weights[source, sel], hidden=hidden, tokens=trace.token[sel].astype(np.int64),
                      step=trace.step[sel], target=trace.experts[source + distance, sel].astype(np.int64),
                      target_weights=trace.weights[source + distance, sel])


def trace_context(trace: RoutingTrace, layer: int, rows: np.ndarray, step: Optional[int] = None) -> LayerContext:
    """A `LayerContext` of MoE layer `layer` for trace rows `rows`, with gate inputs and tokens where recorded.

    Consumers replaying a trace (simulator) give predictors that need hidden states (gate, llapor,
    moeless) what they would see at run time.
    """
    rows = np.asarray(rows)
    if step is None:
        step = int(trace.step[rows[0]]) if rows.size else 0
    return LayerContext(layer=layer, step=int(step),
                        experts=trace.experts[layer, rows].astype(np.int64), weights=trace.weights[layer, rows],
                        hidden=None if trace.hidden is None else trace.hidden[layer, rows].astype(np.float32),
                        tokens=trace.token[rows].astype(np.int64), seq=trace.seq[rows], pos=trace.pos[rows], rows=rows)


def pairs_context(pairs: LayerPairs, sel: slice | np.ndarray = slice(None), step: int = 0) -> LayerContext:
    """A `LayerContext` of the source layer for the rows `sel` of `pairs`."""
    return LayerContext(layer=pairs.source, step=step, experts=pairs.experts[sel], weights=pairs.weights[sel],
                        hidden=None if pairs.hidden is None else pairs.hidden[sel], tokens=pairs.tokens[sel])
