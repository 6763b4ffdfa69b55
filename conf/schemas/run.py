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
from engine.workloads.config import WorkloadConfig


@dataclass
class OffloadConfig:
    """The expert memory budget (at most one of the three; none: a quarter of the experts, capped at half the
    device memory the dense weights leave) and the mechanism's knobs."""

    budget_fraction: Optional[float] = None  # of all routed experts, staging buffers included
    budget_experts: Optional[int] = None
    budget_bytes: Optional[float] = None
    staging_slots: int = 2  # the on-demand double buffer
    chunks: int = 2  # row chunks per projection transfer (3 projections x chunks sub-transfers per expert)
    async_io: bool = True  # False: synchronous copies (LayerScope ablation "no AsyncIO")
    cpu_threads: int = 1  # host threads of the CPU experts (they compute in the weights' own dtype)
    retries: int = 2
    validate_plans: bool = True
    fuse_resident: bool = True  # passes with every routed expert resident run as one device call (see OffloadSettings)


@dataclass
class RunConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING
    scheduler: Any = MISSING  # the `scheduler` group, typed by the chosen policy's own settings
    predictor: PredictorConfig = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]  # the cost model's machine
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # forecasts PreSched may use (Q4); null: 1, 2, 3 where the model has that many later MoE layers
    predictor_distances: Optional[List[int]] = None
    profile_batches: int = 1  # hot-expert table: batches served before the measured ones (Counter)
    # also run the plain in-memory model (tokens / bf16 fidelity, speed ratio); null: where it fits beside the run
    compare_in_memory: Optional[bool] = None
    dtype: DType = DType.auto
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(RunConfig, name="base_run")
