"""Schema of `python -m engine.record`: routing traces of a model serving a workload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from core.config import store
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec
from engine.workloads.config import WorkloadConfig


@dataclass
class RecordConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING
    keep_hidden: bool = True  # store the gate inputs (float16) for predictor training
    out: Optional[str] = None  # trace file; default: <run dir>/trace.npz
    dtype: DType = DType.auto
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(RecordConfig, name="base_record")
