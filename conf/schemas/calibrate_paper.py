"""Schema of `python -m engine.calibrate_paper`: the cost model's free constants fitted to a named subset of
LayerScope's published figures and checked on all the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from core.config import store
from core.telemetry import WandbConfig


@dataclass
class FreeConstant:
    """One fitted constant: the profile keys it sets (`<hardware>:<block>.<field>`, one value for all of them: the
    same physical quantity on every machine listed), the published points it is fitted on and its search range."""

    name: str = ""
    keys: List[str] = field(default_factory=list)
    fit_points: List[str] = field(default_factory=list)
    low: float = 0.0
    high: float = 1.0
    meaning: str = ""


@dataclass
class CalibratePaperConfig:
    published: str = "pkg:engine/data/layerscope_published.yaml"  # the published points (engine/data)
    constants: List[FreeConstant] = field(default_factory=list)
    fit: bool = False  # true: refit the constants on their fit points (else evaluate the shipped profiles)
    rounds: int = 2  # fit: passes over the constants (each solved with the others held)
    tolerance: float = 0.005  # fit: relative precision of each constant
    points: Optional[List[str]] = None  # evaluate only these point ids (None: every evaluable point)
    seeds: List[int] = field(default_factory=lambda: [0])  # synthetic-routing seeds averaged per point
    forecasts: str = "oracle"  # the predictor: oracle (the simulator's default, an upper bound) or a conf/predictor name
    # the same relative points for these variants of a system (rows `<id>@<variant>`, outside the summary)
    variants: Dict[str, List[str]] = field(default_factory=lambda: {"hybrimoe": ["hybrimoe_ls"]})
    limit: float = 0.30  # the goal: every held-out absolute figure within this relative error
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(CalibratePaperConfig, name="base_calibrate_paper")
