"""Schema of `python -m engine.serve`: serverless experts (MoEless) over expert parallelism.

`mode=simulate` replays an Azure trace with the MoEless §3.3 latency / cost model on a hardware
profile (paper-scale models); `mode=real` serves a small model on the available devices (8 host
devices in tests) through the shard_map expert-parallel executor. The `serverless` group holds
the systems' settings; `experiments` picks the studies of MoEless §6 (figures in the run folder).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from conf import unfrozen
from conf.schemas import store
from conf.schemas.common import DType, ModelSpec, WandbConfig
from conf.schemas.hardware import HardwareProfile
from conf.schemas.predictor import PredictorConfig
from conf.schemas.routing import RoutingConfig
from conf.schemas.workload import WorkloadConfig
from engine.serverless.ep_layer import Dispatch
from engine.serverless.latency_model import ComputeKind, LatencyKind
from engine.serverless.policies import PolicyKind


class ServeMode(enum.Enum):
    simulate = "simulate"
    real = "real"


class Experiment(enum.Enum):
    compare = "compare"  # Figs. 11-13: latency CDF and cost of the configured systems
    memory = "memory"  # Fig. 14: latency speedup vs expert memory (EPLB redundancy swept)
    distance = "distance"  # Figs. 17-18: MoEless prediction distance d
    cv_threshold = "cv_threshold"  # Figs. 19-20: MoEless CV threshold V
    ablation = "ablation"  # Fig. 21: MoEless without predictor / scaler / placer


@dataclass
class ForecastConfig:
    """Where MoEless's load forecasts come from: the `predictor` group (at its `distance`), and the
    historical shares for the first d layers of a pass (and everything without a predictor)."""

    use_predictor: bool = True  # False: historical forecasts only
    history_decay: float = 1.0  # EMA weight of the newest step's shares (1: the last step only)


@dataclass
class ScalerConfig:
    cv_threshold: float = 0.2  # V (MoEless §6.4)
    memory_cap_replicas: Optional[int] = None  # M_cap / M_e added replicas per layer; None: every free slot
    max_replicas_per_expert: Optional[int] = None


@dataclass
class PlacerConfig:
    warm_start: bool = True


@dataclass
class EPLBConfig:
    num_redundant: Optional[int] = None  # per layer; None: one per device
    rebalance_interval_s: float = 600.0  # MoEless §6.1: "every ten minutes"
    history_window_s: Optional[float] = None  # None: the rebalance interval
    num_groups: int = 1
    num_nodes: int = 1


@dataclass
class LatencyConfig:
    kind: LatencyKind = LatencyKind.paper
    compute: ComputeKind = ComputeKind.replica_max
    misc_s: Optional[float] = None  # fixed T_misc per layer; None: modelled attention block
    bill_keep_alive: bool = False  # bill MoEless for its kept-alive replicas like a serverful deployment


@dataclass
class SweepConfig:
    distances: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # MoEless §6.4
    cv_thresholds: List[float] = field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8, 1.0])
    eplb_redundant_per_expert: List[int] = field(default_factory=lambda: [0, 1, 2])  # MoEless §6.2, Fig. 14


@dataclass
class ServerlessConfig:
    name: str = MISSING
    num_devices: Optional[int] = None  # G; None: hardware.num_devices (simulate) or every device (real)
    capacity_slots: Optional[int] = None  # MoEless replica slots per device per layer; None: 2 * ceil(E / G)
    dispatch: Dispatch = Dispatch.auto  # real mode: padded all_to_all on CPU, ragged elsewhere
    bytes_per_param: int = 2  # simulate: bf16 experts
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    placer: PlacerConfig = field(default_factory=PlacerConfig)
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    sweeps: SweepConfig = field(default_factory=SweepConfig)


store(ServerlessConfig, name="base_serverless", group="serverless")


@dataclass
class DistributedConfig:
    """Multi-host real mode: `jax.distributed.initialize` before any device is touched."""

    coordinator: Optional[str] = None  # "host:port" of process 0; None: a single process
    num_processes: int = 1
    process_id: int = 0


@dataclass
class ServeConfig:
    model: ModelSpec = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]
    workload: WorkloadConfig = MISSING
    routing: RoutingConfig = MISSING
    serverless: ServerlessConfig = MISSING
    predictor: PredictorConfig = MISSING  # the load predictor (any `predictor` group option; d = predictor.distance)
    # simulate: record the routing by serving the replayed requests (ShareGPT text of the trace's
    # lengths) with this trained checkpoint (same experts / top-k as `model`) instead of `routing`
    routing_checkpoint: Optional[str] = None
    mode: ServeMode = ServeMode.simulate
    systems: List[PolicyKind] = field(default_factory=lambda: [PolicyKind.static_ep, PolicyKind.eplb,
                                                               PolicyKind.oracle, PolicyKind.moeless])
    experiments: List[Experiment] = field(default_factory=lambda: [Experiment.compare])
    decode_stride: int = 1  # simulate: keep every n-th decode iteration (weight n)
    max_batches: Optional[int] = None  # stop after this many non-empty batches
    verify: bool = True  # real mode: compare every step with the in-memory experts
    dtype: DType = DType.auto  # real mode
    plots: bool = True
    seed: int = 0
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    notes: Optional[str] = None


store(ServeConfig, name="base_serve")
