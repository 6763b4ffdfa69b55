"""Expert-activation and expert-load predictors (stats, transition, gate, token, LLaPor, MoEless, oracle).

Consumers call `load_predictor(cfg.predictor, model=..., trace=...)` (`predictors.factory`; jax is loaded
only when a trained kind is built, not by importing `predictors`); the contract is `predictors.base.Predictor`.
Training and evaluation: `python -m predictors.train`.
"""

from __future__ import annotations

from predictors.base import HitStats, LayerContext, Predictor, predicted_loads, topk_experts
from predictors.factory import load_predictor, make_predictors

__all__ = ["HitStats", "LayerContext", "Predictor", "load_predictor", "make_predictors", "predicted_loads",
           "topk_experts"]
