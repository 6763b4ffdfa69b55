"""Schema of `python -m engine.calibrate`: measure this machine into a hardware profile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from core.config import store
from core.telemetry import WandbConfig
from models.loading import ModelSpec


@dataclass
class CalibrateConfig:
    model: ModelSpec = MISSING
    name: str = "local"  # the profile's name (and file stem)
    out: Optional[str] = None  # where to write the YAML; default: <run dir>/<name>.yaml
    repeats: int = 5
    token_counts: List[int] = field(default_factory=lambda: [1, 4, 16, 64])  # CPU / device expert timings
    batch: int = 8  # decode batch of the executor run that measures the fixed host times per layer / pass
    prompt_len: int = 32
    new_tokens: int = 16
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(CalibrateConfig, name="base_calibrate")
