"""Schema of `python -m models.generate`: plain in-memory generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from core.config import store
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GenerateConfig:
    model: ModelSpec = MISSING
    prompts: List[str] = field(default_factory=list)  # empty: random token prompts of prompt_len
    batch_size: int = 4
    prompt_len: int = 64
    max_new_tokens: int = 64
    dtype: DType = DType.auto
    seed: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    notes: Optional[str] = None


store(GenerateConfig, name="base_generate")
