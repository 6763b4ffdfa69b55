"""Schema of `python -m engine.simulate`: one offloaded generation replayed in the discrete-event simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from core.config import unfrozen, store
from core.telemetry import WandbConfig
from models.loading import ModelSpec
from schedulers.hardware import HardwareProfile
from predictors.config import PredictorConfig
from engine.sim.pipeline import PlanningCharge
from engine.sim.routing import RoutingConfig


@dataclass
class HotTableConfig:
    """Profiling runs that rank experts for the hot-expert table (LayerScope §4.1 Counter)."""

    profile_sequences: Optional[int] = 32  # synthetic: prompts of fresh traffic of the same model (None: profile_batches batches)
    profile_batches: int = 2  # traces: the first batches are held out for profiling
    seed: int = 1000  # synthetic profiling traffic seed (added to the run seed)


@dataclass
class TimelineConfig:
    plot: bool = True  # per-layer GPU / CPU / PCIe lanes of one forward pass (LayerScope Figure 3)
    step: int = 1  # forward pass to draw (0 = prefill, 1 = first decode step)
    max_layers: Optional[int] = 8  # MoE layers drawn (None: all)


@dataclass
class BoundsConfig:
    lower_bound: bool = True  # a bound no schedule can beat (engine.sim.bounds)
    oracle: bool = False  # exact best schedule by search: small instances only


@dataclass
class StudyConfig:
    """One job of a study multirun (`conf/experiment/<study>.yaml`, `engine.studies`): `kind` null runs the one
    configured simulation; otherwise the job replays its routing under every system x machine (`systems`,
    `hit_rates`) or one PreSched cost regime (`presched_regime`) and writes the rows into results.json."""

    kind: Optional[str] = None  # systems | hit_rates | presched_regime | horizon
    systems: List[str] = field(default_factory=list)  # conf/scheduler names (`presched_no_async`: synchronous copies)
    machines: List[str] = field(default_factory=list)  # conf/hardware names every system runs on (default: hardware)
    hit_rates: List[str] = field(default_factory=list)  # kind hit_rates: the points (engine.bench.bench_simulate_sweep)
    regime: Optional[str] = None  # kind presched_regime: a name of engine.bench.bench_presched_regimes.REGIMES
    forecasts: str = "transition"  # kind horizon: the forecasts every policy plans from (a sweep_predictor point)


@dataclass
class SimulateConfig:
    model: ModelSpec = MISSING
    hardware: unfrozen(HardwareProfile) = MISSING  # type: ignore[valid-type]
    scheduler: Any = MISSING  # the `scheduler` group, typed by the chosen policy's own settings
    routing: unfrozen(RoutingConfig) = MISSING  # type: ignore[valid-type]  # owned by engine.sim.routing
    batch_size: int = 16
    prompt_len: int = 512
    gen_len: int = 64  # tokens generated per sequence (the prefill yields the first)
    num_batches: int = 1
    bytes_per_param: int = 2  # bf16 experts (LayerScope Table 3)
    async_io: bool = True  # False: synchronous pageable copies (LayerScope ablation "no AsyncIO")
    predictor: PredictorConfig = MISSING  # the `predictor` group: oracle (default) or a trained checkpoint
    hot_table: HotTableConfig = field(default_factory=HotTableConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    bounds: BoundsConfig = field(default_factory=BoundsConfig)
    check_invariants: bool = False  # assert the mechanism's invariants while simulating (tests)
    cache_slots: Optional[int] = None  # override the expert-cache size the memory plan gives (small studies)
    # the policy's own plan time on the host per MoE layer (engine.sim.pipeline.PlanningCharge): mode off (default) |
    # measured | measured_cpu | fixed (fixed_us per scheduler kind, search_us more for a plan that ran its search)
    planning: unfrozen(PlanningCharge) = field(default_factory=unfrozen(PlanningCharge))  # type: ignore[valid-type]
    seed: int = 0
    study: StudyConfig = field(default_factory=StudyConfig)  # a study multirun's job (conf/experiment)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    notes: Optional[str] = None


store(SimulateConfig, name="base_simulate")
