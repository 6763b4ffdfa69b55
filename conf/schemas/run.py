"""Schema of `python -m engine.run`: real offloaded inference (LayerScope) of a model serving a workload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from core.config import unfrozen, store
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec
from schedulers.hardware import HardwareProfile
from predictors.config import PredictorConfig
from engine.offload.settings import OffloadSettings
from engine.workloads.config import WorkloadConfig


@dataclass
class RunConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING
    scheduler: Any = MISSING  # the `scheduler` group, typed by the chosen policy's own settings
    predictor: PredictorConfig = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]  # the cost model's machine
    offload: OffloadSettings = field(default_factory=OffloadSettings)  # owned by engine.offload
    # forecasts PreSched may use (Q4); null: 1, 2, 3 where the model has that many later MoE layers
    predictor_distances: Optional[List[int]] = None
    profile_batches: int = 1  # hot-expert table: batches served before the measured ones (Counter)
    # also run the plain in-memory model (tokens / bf16 fidelity, speed ratio); null: where it fits beside the run
    compare_in_memory: Optional[bool] = None
    dtype: DType = DType.auto
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(RunConfig, name="base_run")
