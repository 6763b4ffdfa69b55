"""Expert-activation and expert-load predictors (stats, gate, token, LLaPor, MoEless, oracle).

Consumers call `load_predictor(cfg.predictor, model=..., trace=...)`; the contract is
`predictors.base.Predictor`. Training and evaluation: `python -m predictors.train`.
"""

from __future__ import annotations

from typing import Any, Optional

from predictors.base import HitStats, LayerContext, Predictor, predicted_loads, topk_experts


def load_predictor(node_or_cfg: Any, model: Any = None, trace: Any = None, distance: Optional[int] = None) -> Predictor:
    """A predictor from a `predictor` config node (see `predictors.factory.load_predictor`).

    Imported lazily: jax is loaded only when a predictor is built, not by importing `predictors`.
    """
    from predictors.factory import load_predictor as load

    return load(node_or_cfg, model=model, trace=trace, distance=distance)


__all__ = ["HitStats", "LayerContext", "Predictor", "load_predictor", "predicted_loads", "topk_experts"]
