"""The noisy oracle predictor honours the Predictor protocol and its configured hit rate."""

from __future__ import annotations

import numpy as np
import pytest

from engine.synthetic_routing import SyntheticRouter
from predictors.base import LayerContext, Predictor, topk_experts
from predictors.oracle import NoisyOraclePredictor, count_hits


def ctx_for(trace, layer: int, rows: np.ndarray) -> LayerContext:
    return LayerContext(layer=layer, step=0, experts=trace.experts[layer, rows], weights=trace.weights[layer, rows],
                        rows=rows)


@pytest.fixture(scope="module")
def trace():
    return SyntheticRouter(4, 16, 4, model_seed=0).trace(8, 32, 4, seed=1)


def test_perfect_oracle_returns_the_truth(trace) -> None:
    p = NoisyOraclePredictor(trace, distance=2, hit_rate=1.0)
    assert isinstance(p, Predictor)
    rows = np.arange(trace.num_rows)
    ctx = ctx_for(trace, 1, rows)
    assert np.array_equal(p.predict_topk(ctx), trace.experts[3, rows])
    # the scores rank exactly the true experts on top
    assert np.array_equal(np.sort(topk_experts(p.predict(ctx), 4), axis=1), np.sort(trace.experts[3, rows], axis=1))
    p.observe(3, ctx, trace.experts[3, rows])
    assert p.hit_rate() == 1.0


@pytest.mark.parametrize("target", [0.9, 0.6])
def test_noisy_oracle_hits_at_the_configured_rate(trace, target: float) -> None:
    p = NoisyOraclePredictor(trace, distance=1, hit_rate=target, seed=3)
    rows = np.arange(trace.num_rows)
    for layer in range(3):
        ctx = ctx_for(trace, layer, rows)
        pred = p.predict_topk(ctx)
        true = trace.experts[layer + 1, rows]
        srt = np.sort(pred, axis=1)
        assert not (srt[:, 1:] == srt[:, :-1]).any()  # still k distinct experts per token
        p.observe(layer + 1, ctx, true, predicted=pred)
    assert p.hit_rate() == pytest.approx(target, abs=0.02)


def test_count_hits_by_hand() -> None:
    assert count_hits(np.array([[1, 2], [3, 4]]), np.array([[2, 5], [4, 3]])) == 3


def test_bad_arguments(trace) -> None:
    with pytest.raises(ValueError, match="hit_rate"):
        NoisyOraclePredictor(trace, hit_rate=1.2)
    p = NoisyOraclePredictor(trace, distance=3)
    with pytest.raises(ValueError, match="target layer 5"):
        p.predict_topk(ctx_for(trace, 2, np.arange(4)))
