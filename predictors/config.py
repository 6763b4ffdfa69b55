"""Predictor configs as typed objects: from a Hydra node, a plain dict or a saved checkpoint."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from conf.schemas.predictor import PredictorConfig


def predictor_config(node: Any) -> PredictorConfig:
    """A validated `PredictorConfig` from a `predictor` node, a dict or a `PredictorConfig` (errors name the key)."""
    if isinstance(node, PredictorConfig):
        return node
    if not isinstance(node, (DictConfig, dict)):
        raise TypeError(f"predictor config: expected a DictConfig, dict or PredictorConfig, got {type(node).__name__}")
    merged = OmegaConf.merge(OmegaConf.structured(PredictorConfig), node)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def config_dict(cfg: PredictorConfig) -> dict[str, Any]:
    """JSON-ready dict of a predictor config (enums by name)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)  # type: ignore[return-value]
