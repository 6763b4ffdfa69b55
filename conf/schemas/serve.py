"""Schema of `python -m engine.serve`: serverless experts (MoEless) over expert parallelism.

`mode=simulate` replays an Azure trace with the MoEless §3.3 latency / cost model on a hardware
profile (paper-scale models); `mode=real` serves a small model on the available devices (8 host
devices in tests) through the shard_map expert-parallel executor. The `serverless` group holds
the serving setup and, under `serverless.policies.<kind>`, the settings of every registered serverless
policy (`schedulers.ep_placement.SERVERLESS`), each from `conf/serverless/policy/<kind>.yaml` checked
against that policy's own settings; `systems` picks the policies compared, `experiments` the studies of
MoEless §6 (figures in the run folder).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from core.config import CONF_DIR, unfrozen, store
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec
from schedulers.hardware import HardwareProfile
from predictors.config import PredictorConfig
from engine.sim.routing import RoutingConfig
from engine.workloads.config import WorkloadConfig
from engine.serverless.dispatch import Dispatch
from engine.serverless.latency_model import Billing, ComputeKind, LatencyKind
from schedulers.ep_placement import SERVERLESS


class ServeMode(enum.Enum):
    simulate = "simulate"
    real = "real"


class Experiment(enum.Enum):
    compare = "compare"  # Figs. 11-13: latency CDF and cost of the configured systems
    memory = "memory"  # Fig. 14: latency speedup vs expert memory (EPLB redundancy swept)
    distance = "distance"  # Figs. 17-18: MoEless prediction distance d
    cv_threshold = "cv_threshold"  # Figs. 19-20: MoEless CV threshold V
    ablation = "ablation"  # Fig. 21: MoEless without predictor / scaler / placer
    frontier = "frontier"  # MoE-layer latency vs GPU memory held, every system and setting (FRONTIER)


@dataclass
class ForecastConfig:
    """Where MoEless's load forecasts come from: the `predictor` group (at its `distance`), and the
    historical shares for the first d layers of a pass (and everything without a predictor)."""

    use_predictor: bool = True  # False: historical forecasts only
    history_decay: float = 1.0  # EMA weight of the newest step's shares (1: the last step only)


@dataclass
class LatencyConfig:
    kind: LatencyKind = LatencyKind.roofline  # the CostModel's physical layer time; `paper`: MoEless §3.3's formula
    compute: ComputeKind = ComputeKind.device_sum
    misc_s: Optional[float] = None  # fixed T_misc per layer; None: modelled attention block
    # headline cost: held (GPU memory held x time, kept-alive replicas included; MoEless §3.3) or
    # pay_per_use (serverless replicas billed only while their layer runs); results report both
    billing: Billing = Billing.held


@dataclass
class SweepConfig:
    distances: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # MoEless §6.4
    cv_thresholds: List[float] = field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8, 1.0])
    eplb_redundant_per_expert: List[int] = field(default_factory=lambda: [0, 1, 2])  # MoEless §6.2, Fig. 14


for _kind, _settings in SERVERLESS.schemas():
    store(unfrozen(_settings), name=f"base_{_kind}", group="serverless/policy")


def policy_defaults() -> list[Any]:
    """The `serverless` group's defaults list: every registered serverless policy's settings at
    `serverless.policies.<kind>`, from its conf/serverless/policy/<kind>.yaml (the bare schema without one)."""
    folder = CONF_DIR / "serverless" / "policy"
    return ["_self_", *({f"policy@policies.{kind}": kind if (folder / f"{kind}.yaml").is_file() else f"base_{kind}"}
                        for kind in SERVERLESS.names())]


@dataclass
class ServerlessConfig:
    defaults: List[Any] = field(default_factory=policy_defaults)
    name: str = MISSING
    num_devices: Optional[int] = None  # G; None: hardware.num_devices (simulate) or every device (real)
    dispatch: Dispatch = Dispatch.auto  # real mode: padded all_to_all on CPU, ragged elsewhere
    bytes_per_param: int = 2  # simulate: bf16 experts
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    sweeps: SweepConfig = field(default_factory=SweepConfig)
    # kind -> that policy's settings (schedulers/serverless/<module>.py), one node per registered policy
    policies: Dict[str, Any] = field(default_factory=dict)


store(ServerlessConfig, name="base_serverless", group="serverless")


@dataclass
class DistributedConfig:
    """Multi-host real mode: `jax.distributed.initialize` before any device is touched."""

    coordinator: Optional[str] = None  # "host:port" of process 0; None: a single process
    num_processes: int = 1
    process_id: int = 0


@dataclass
class ServeStudyConfig:
    """One job of a serve study multirun (`conf/experiment/serverless_regimes.yaml`): `regime` names a point of
    engine.bench.bench_serverless_regimes (one knob moved from the defaults, e.g. `skew_0.6`; `default`), applied
    to the composed config before the job runs (`engine.studies.serve_study_node`); null: the config as composed."""

    regime: Optional[str] = None


@dataclass
class ServeConfig:
    model: ModelSpec = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]
    workload: WorkloadConfig = MISSING
    routing: unfrozen(RoutingConfig) = MISSING  # type: ignore[valid-type]
    serverless: ServerlessConfig = MISSING
    predictor: PredictorConfig = MISSING  # the load predictor (any `predictor` group option; d = predictor.distance)
    # simulate: record the routing by serving the replayed requests (ShareGPT text of the trace's
    # lengths) with this trained checkpoint (same experts / top-k as `model`) instead of `routing`
    routing_checkpoint: Optional[str] = None
    mode: ServeMode = ServeMode.simulate
    # the serverless policies compared (names of `serverless.policies`)
    systems: List[str] = field(default_factory=lambda: ["static_ep", "eplb", "oracle", "moeless"])
    experiments: List[Experiment] = field(default_factory=lambda: [Experiment.compare])
    decode_stride: int = 1  # simulate: keep every n-th decode iteration (weight n)
    max_batches: Optional[int] = None  # stop after this many non-empty batches
    verify: bool = True  # real mode: the in-memory model teacher-forced on the served tokens, within the bf16 envelope
    # real mode: the longest request (prompt + output tokens) served; the shard_map executor runs eagerly, and
    # on host devices a longer pass outlasts XLA's collective timeout and aborts the process mid-run. Checked
    # before anything is served (cap the trace with workload.azure.max_context_tokens / max_generated_tokens)
    real_max_context_tokens: int = 512
    dtype: DType = DType.auto  # real mode
    plots: bool = True
    seed: int = 0
    study: ServeStudyConfig = field(default_factory=ServeStudyConfig)  # a serve study multirun's job
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    notes: Optional[str] = None


store(ServeConfig, name="base_serve")
