"""Schema of `python -m engine.stats`: routing statistics of a trace file or of a model on a workload."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from core.config import store
from core.telemetry import WandbConfig
from core.trace_import import TraceFileFormat
from models.loading import ModelSpec
from engine.workloads.config import WorkloadConfig


class StatsSource(enum.Enum):
    trace = "trace"  # a routing-trace file (`trace`)
    model = "model"  # record the routing of `model` serving `workload`


@dataclass
class StatsConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING
    source: StatsSource = StatsSource.model
    trace: Optional[str] = None  # source=trace: the file (pkg: paths allowed)
    trace_format: TraceFileFormat = TraceFileFormat.auto
    num_experts: Optional[int] = None  # vLLM logs: experts per layer; None: largest id seen + 1
    drop_incomplete: bool = False  # vLLM logs: drop tokens missing some layer (default: fail naming the line)
    distances: List[int] = field(default_factory=lambda: [1, 2, 3, 4])  # layer distances d (l -> l+d)
    hot_factor: float = 2.0  # an expert is hot when its load share >= hot_factor / num_experts
    test_fraction: float = 0.25  # predictability: share of sequences held out to test the tables
    split_seed: int = 0
    save_trace: bool = True  # source=model: write the recorded trace (trace.npz) into the run folder
    plots: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(StatsConfig, name="base_stats")
