"""Schema of `python -m engine.run`: real offloaded inference (LayerScope) of a model serving a workload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from conf import unfrozen
from conf.schemas import store
from conf.schemas.common import DType, ModelSpec, WandbConfig
from conf.schemas.hardware import HardwareProfile
from conf.schemas.predictor import PredictorConfig
from conf.schemas.workload import WorkloadConfig
from schedulers.base import SchedulerSettings


@dataclass
class OffloadConfig:
    """The expert memory budget (exactly one of the three) and the mechanism's knobs."""

    budget_fraction: Optional[float] = 0.25  # of all routed experts, staging buffers included
    budget_experts: Optional[int] = None
    budget_bytes: Optional[float] = None
    staging_slots: int = 2  # the on-demand double buffer
    chunks: int = 2  # row chunks per projection transfer (3 projections x chunks sub-transfers per expert)
    async_io: bool = True  # False: synchronous copies (LayerScope ablation "no AsyncIO")
    cpu_threads: int = 1  # torch threads of the CPU-expert worker (0: torch's default)
    cpu_dtype: DType = DType.float32
    retries: int = 2
    validate_plans: bool = True
    fuse_resident: bool = True  # passes with every routed expert resident run as one device call (see OffloadSettings)


@dataclass
class RunConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING
    scheduler: unfrozen(SchedulerSettings) = MISSING  # type: ignore[valid-type]
    predictor: PredictorConfig = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]  # the cost model's machine
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    predictor_distances: List[int] = field(default_factory=lambda: [1, 2, 3])  # forecasts PreSched may use (Q4)
    profile_batches: int = 1  # hot-expert table: batches served before the measured ones (Counter)
    compare_in_memory: bool = True  # also run the plain in-memory model: tokens must match, speed ratio
    dtype: DType = DType.float32
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(RunConfig, name="base_run")
