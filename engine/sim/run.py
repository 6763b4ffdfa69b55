"""One simulated run from plain settings: routing, memory plan, cost model, scheduler, predictors.

`RunSpec` is what the Hydra entry point (`engine.simulate.spec_from_config`) and the sweep benchmark both build;
`prepare_routing` is cached by the sweep so every system replays the same routing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from core.trace import RoutingTrace
from engine.offload.forecasts import ForecastBook
from engine.sim.pipeline import PipelineSim, PlanningCharge, SimOptions
from engine.sim.measured import oracle_default
from engine.sim.routing import RoutingConfig, RoutingSource, load_routing_file, tile_layers
from engine.sim.workload import ForwardPass, batch_sequences, forward_passes, profile_loads, sequences_per_batch
from engine.synthetic_routing import SyntheticRouter
from models.config import ModelConfig
from predictors.config import NEEDS_HIDDEN, ROUTING_ONLY, PredictorConfig, PredictorKind, oracle_config
from predictors.factory import make_predictors
from schedulers.base import SchedulerSettings, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel, MemoryPlan, memory_plan
from schedulers.hardware import HardwareProfile

__all__ = ["RunSpec", "RoutingConfig", "PreparedRouting", "prepare_routing", "build_sim", "simulate",
           "load_routing_file", "tile_layers", "forecast_distances", "simulator_predictors"]


def default_predictor() -> PredictorConfig:
    """The simulator's default forecasts: the oracle (an upper bound) degraded per distance to the hit rates
    moescope's own LLaPor measured on its own trained mixtral-tiny (engine/data/measured_hit_rates.yaml, which
    names the source and the command that re-measures it); `predictor=stats|transition|...` runs real predictors."""
    m = oracle_default()
    return oracle_config(hit_rate=m["hit_rates"][0], hit_rates=m["hit_rates"], distance_decay=m["distance_decay"],
                         source=m["source"])


@dataclass(frozen=True)
class RunSpec:
    """One simulated run, from typed parts: the resolved model, machine and policy settings, the owned `routing` and
    `predictor` configs (None: no forecasts) and the run's sizes. `spec_from_config` builds it from a composed
    `simulate` config; sweeps and tests build it directly."""

    model: ModelConfig
    model_name: str
    hardware: HardwareProfile
    scheduler: SchedulerSettings
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    batch_size: int = 16
    prompt_len: int = 512
    gen_len: int = 64
    num_batches: int = 1
    bytes_per_param: int = 2
    expert_format: str = "bf16"  # the routed experts' `model.expert_format`: their bytes and CPU rates (schedulers/formats.py)
    async_io: bool = True
    predictor: Optional[PredictorConfig] = field(default_factory=default_predictor)
    profile_batches: int = 2  # traces: batches held out for the hot table and for fitting predictors
    profile_sequences: Optional[int] = 32  # synthetic: prompts of the profiling run (None: profile_batches batches)
    profile_seed: int = 1000
    seed: int = 0
    check_invariants: bool = False
    cache_slots: Optional[int] = None  # override the memory plan's expert-cache size (small studies)
    planning: PlanningCharge = field(default_factory=PlanningCharge)  # the policy's plan time on the host (default off)

    @property
    def sequences(self) -> int:
        """Sequences in one forward pass: the batch times the batches the policy keeps in flight (Klotski's
        multi-batch pipeline runs two batches of `batch_size` through every layer together)."""
        return self.batch_size * self.scheduler.in_flight

    def with_scheduler(self, settings: SchedulerSettings) -> "RunSpec":
        return replace(self, scheduler=settings)


@dataclass
class PreparedRouting:
    trace: RoutingTrace
    passes: list[ForwardPass]
    profile: np.ndarray  # int64 [L, E] profiling loads for the hot table
    train: Optional[RoutingTrace] = None  # routing held out of the replay: what stats / transition predictors fit on
    # (predictor config, distance) -> the routing-only predictor fitted on `train`, as fitted (never run): every
    # system of a study replays one routing, and refitting the same tables per system cost more than some replays
    fitted: dict[tuple[str, int], Any] = field(default_factory=dict)


def prepare_routing(spec: RunSpec) -> PreparedRouting:
    """The routing to replay, the profiling loads and the routing predictors may be fitted on, from the spec's
    routing source (a log's held-out batches; synthetic: fresh traffic of the same model)."""
    cfg, r = spec.model, spec.routing
    if r.source is RoutingSource.synthetic:
        router = SyntheticRouter.for_model(cfg, r.synthetic, model_seed=r.model_seed, model_name=spec.model_name)
        trace = router.trace(spec.sequences, spec.prompt_len, spec.gen_len, seed=spec.seed,
                             num_batches=spec.num_batches)
        if spec.profile_sequences:
            prof = router.trace(spec.profile_sequences, spec.prompt_len, spec.gen_len, seed=spec.seed + spec.profile_seed)
        else:
            prof = router.trace(spec.batch_size, spec.prompt_len, spec.gen_len, seed=spec.seed + spec.profile_seed,
                                num_batches=max(spec.profile_batches, 1))
        return PreparedRouting(trace, forward_passes(trace), profile_loads(prof), train=prof)
    trace = load_routing_file(r, cfg, with_hidden=spec.predictor is not None and spec.predictor.kind in NEEDS_HIDDEN)
    sequences = int(np.unique(trace.seq).size)
    if spec.sequences > sequences:
        raise ValueError(f"batch_size={spec.batch_size}: routing.path={r.path} holds {sequences} sequences, and a batch "
                         f"is built from whole sequences; use batch_size<={sequences}")
    if sequences_per_batch(trace) != spec.sequences:
        trace = batch_sequences(trace, spec.sequences)
    passes = forward_passes(trace)
    batches = sorted({p.batch_id for p in passes})
    held = set(batches[:spec.profile_batches]) if len(batches) > spec.profile_batches else set()
    kept = [b for b in batches if b not in held][:max(spec.num_batches, 1)]  # replay num_batches batches
    short = [b for b in kept if np.unique(trace.seq[trace.batch == b]).size < spec.sequences]
    if short:
        raise ValueError(f"batch_size={spec.batch_size}: routing.path={r.path} holds {sequences} sequences, so replayed "
                         f"batch {short[0]} would have fewer; lower num_batches ({spec.num_batches}) or batch_size, or "
                         f"hold out fewer (hot_table.profile_batches={spec.profile_batches})")
    prof_rows = [p.rows for p in passes if p.batch_id in held]
    replay = [p for p in passes if p.batch_id in set(kept)]
    profile = trace.expert_loads(np.concatenate(prof_rows)) if prof_rows else trace.expert_loads()
    train = trace.select(np.concatenate(prof_rows)) if prof_rows else None
    for i, p in enumerate(replay):
        p.index = i
    return PreparedRouting(trace, replay, profile, train=train)


def forecast_distances(spec: RunSpec) -> list[int]:
    """The distances the scheduler may read forecasts at (none without a predictor or with `use_predictor` off)."""
    if spec.predictor is None or not spec.scheduler.use_predictor:
        return []
    return [d for d in range(1, spec.scheduler.forecast_window + 1) if d < len(spec.model.moe_layers)]


def simulator_predictors(spec: RunSpec, routing: PreparedRouting) -> dict[int, Any]:
    """The run's predictors by distance: the oracle reads the replayed routing (an upper bound), stats and
    transition tables are fitted on the routing held out of the replay, trained checkpoints read what the
    replayed trace holds (gate inputs for gate / LLaPor / MoEless). Errors name what is missing."""
    distances = forecast_distances(spec)
    if not distances:
        return {}
    p = spec.predictor
    assert p is not None
    where = f"predictor={p.name} (kind {p.kind.value})"
    if p.kind in ROUTING_ONLY and not p.checkpoint and routing.train is None:
        raise ValueError(f"{where}: fitted on the routing held out of the replay, and routing.path={spec.routing.path} "
                         f"gives no batch beyond the replayed ones; lower hot_table.profile_batches / num_batches or "
                         f"batch_size, or set predictor.checkpoint")
    if p.kind in NEEDS_HIDDEN and routing.trace.hidden is None:
        raise ValueError(f"{where}: needs the gate inputs (hidden states) of the replayed routing, and "
                         f"routing={spec.routing.name} has none; replay a trace recorded with them (routing=trace "
                         f"routing.path=<engine.record trace.npz> of the predictor's model), or use "
                         f"predictor=stats|transition|oracle")
    if p.kind in (PredictorKind.llapor, PredictorKind.moeless) and not p.checkpoint:
        raise ValueError(f"{where}: set predictor.checkpoint to a folder written by `python -m predictors.train`")
    if p.kind is PredictorKind.gate and not p.checkpoint:
        raise ValueError(f"{where}: the simulator has no model weights to copy the routers from; set "
                         "predictor.checkpoint (a gate predictor saved by `python -m predictors.train`)")
    if p.kind is PredictorKind.token and (p.checkpoint is None or (routing.trace.token < 0).any()):
        raise ValueError(f"{where}: needs a checkpoint and the token ids of the replayed routing "
                         f"(routing={spec.routing.name} has {'none' if (routing.trace.token < 0).any() else 'them'})")
    if p.kind in ROUTING_ONLY and not p.checkpoint:  # deterministic fits of `train`: fit once, hand out fresh copies
        fitted = routing.fitted
        for d in distances:  # one fit per distance, whatever window each policy reads
            if (repr(p), d) not in fitted:
                fitted[(repr(p), d)] = make_predictors(p, [d], trace=routing.trace, train=routing.train)[d]
        return copy.deepcopy({d: fitted[(repr(p), d)] for d in distances})  # a run's predictors score as they go
    return make_predictors(p, distances, trace=routing.trace, train=routing.train)


@dataclass
class RunOutcome:
    spec: RunSpec
    summary: dict[str, Any]
    memory: MemoryPlan
    cost: CostModel
    sim: PipelineSim


def build_sim(spec: RunSpec, routing: PreparedRouting, record: bool = False,
              record_passes: Optional[set[int]] = None) -> tuple[PipelineSim, MemoryPlan, CostModel]:
    """The simulator of `spec` (scheduler, predictors, memory) ready to replay `routing`."""
    mem = memory_plan(spec.model, spec.hardware, spec.sequences, spec.prompt_len, spec.gen_len,
                      staging_slots=spec.scheduler.staging_slots, bytes_per_param=spec.bytes_per_param,
                      expert_format=spec.expert_format)
    if spec.cache_slots is not None:
        mem = replace(mem, cache_slots=int(spec.cache_slots))
    cost = CostModel(spec.model, spec.hardware, model_name=spec.model_name, bytes_per_param=spec.bytes_per_param,
                     expert_format=spec.expert_format)
    setup = SchedulerSetup(num_layers=len(spec.model.moe_layers), num_experts=spec.model.num_experts,
                           top_k=spec.model.num_experts_per_tok, cache_slots=mem.cache_slots, cost=cost,
                           profile_loads=routing.profile, planning=spec.planning.price(spec.scheduler.kind))
    scheduler = build_scheduler(spec.scheduler, setup)
    predictors = simulator_predictors(spec, routing)
    book = ForecastBook(routing.trace, predictors) if predictors else None
    sim = PipelineSim(cfg=spec.model, cost=cost, scheduler=scheduler, cache_slots=mem.cache_slots,
                      staging_slots=spec.scheduler.staging_slots, trace=routing.trace, forecasts=book,
                      options=SimOptions(planning=spec.planning, async_io=spec.async_io,
                                         check_invariants=spec.check_invariants,
                                         record=record, record_passes=record_passes))
    return sim, mem, cost


def simulate(spec: RunSpec, routing: Optional[PreparedRouting] = None, record: bool = False,
             record_passes: Optional[set[int]] = None) -> RunOutcome:
    """Run one simulation; `routing` reuses a prepared replay (sweeps)."""
    routing = routing or prepare_routing(spec)
    sim, mem, cost = build_sim(spec, routing, record, record_passes)
    metrics = sim.run(routing.passes)
    generated = sum(p.num_seqs for p in routing.passes)  # every pass yields one token per sequence
    summary = metrics.summary(generated)
    summary["cache_slots"] = mem.cache_slots
    summary["experts_total"] = spec.model.num_experts * len(spec.model.moe_layers)
    summary["cost"] = cost.summary()
    if spec.planning.mode != "off":
        summary.update(planning_summary(spec.planning, sim.planning_s))
    return RunOutcome(spec, summary, mem, cost, sim)


def planning_summary(charge: PlanningCharge, calls: list[tuple[bool, float]]) -> dict[str, Any]:
    """What a run with its planning charged paid (`planning_charged_*`: µs per decode plan call, seconds in all)."""
    decode = np.asarray([s for prefill, s in calls if not prefill]) * 1e6
    some = decode.size > 0
    return {"planning_charge": charge.mode, "planning_charged_s": float(sum(s for _, s in calls)),
            "planning_charged_median_us_decode": float(np.median(decode)) if some else 0.0,
            "planning_charged_p99_us_decode": float(np.percentile(decode, 99)) if some else 0.0,
            "planning_charged_mean_us_decode": float(decode.mean()) if some else 0.0}
