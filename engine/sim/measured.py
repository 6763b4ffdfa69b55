"""The measured predictor hit rates (engine/data/measured_hit_rates.yaml): the default oracle's hit rate per
distance, with its source, and the realistic predictors' marks in the hit-rate sweep. Light (no JAX): read by
the simulator's defaults and by `engine.report`."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

MEASURED_FILE = Path(__file__).resolve().parents[1] / "data" / "measured_hit_rates.yaml"


@lru_cache(maxsize=1)
def measured_hit_rates() -> dict[str, Any]:
    """The whole file as plain containers (distances as int keys)."""
    return OmegaConf.to_container(OmegaConf.load(MEASURED_FILE), resolve=True)  # type: ignore[return-value]


def oracle_default() -> dict[str, Any]:
    """The default oracle: `hit_rates` (per distance 1, 2, ...), `distance_decay` and `source`, from the LLaPor
    measurement of `oracle_default.model`."""
    data = measured_hit_rates()
    spec = data["oracle_default"]
    by_d = data["llapor"][spec["model"]]["hit_rate"]
    hit_rates = [float(by_d[d]) for d in sorted(by_d)]
    return {"hit_rates": hit_rates, "distance_decay": float(spec["distance_decay"]), "source": str(spec["source"])}


def realistic_d1() -> tuple[str, dict[str, float]]:
    """(model, predictor kind -> measured d = 1 hit rate), best first."""
    spec = measured_hit_rates()["realistic_d1"]
    rates = {str(k): float(v) for k, v in spec["hit_rate"].items()}
    return str(spec["model"]), dict(sorted(rates.items(), key=lambda kv: -kv[1]))
