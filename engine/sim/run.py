"""One simulated run from plain settings: routing, memory plan, cost model, scheduler, predictors.

`RunSpec` is what the Hydra entry point (`engine.simulate`) and the sweep benchmark both build;
`prepare_routing` is cached by the sweep so every system replays the same routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from schedulers.hardware import HardwareProfile, composed_profile
from engine.sim.pipeline import PipelineSim, SimOptions
from engine.offload.forecasts import ForecastBook
from engine.sim.workload import ForwardPass, batch_sequences, forward_passes, profile_loads, sequences_per_batch
from engine.synthetic_routing import SyntheticRouter, SyntheticRoutingParams
from core.trace import RoutingTrace
from models.config import ModelConfig
from predictors.oracle import NoisyOraclePredictor
from schedulers.base import SchedulerSettings, SchedulerSetup, build_scheduler, scheduler_settings
from schedulers.cost import CostModel, MemoryPlan, memory_plan


@dataclass(frozen=True)
class RoutingSpec:
    source: str = "synthetic"  # synthetic | trace | jsonl
    name: str = "synthetic"
    path: Optional[str] = None
    model_seed: int = 0
    synthetic: SyntheticRoutingParams = field(default_factory=SyntheticRoutingParams)


@dataclass(frozen=True)
class PredictorSpec:
    kind: str = "oracle"  # oracle | none
    hit_rate: float = 0.95
    distance_decay: float = 0.9
    seed: int = 0


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    model_name: str
    hardware: HardwareProfile
    scheduler: SchedulerSettings
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    batch_size: int = 16
    prompt_len: int = 512
    gen_len: int = 64
    num_batches: int = 1
    bytes_per_param: int = 2
    async_io: bool = True
    predictor: PredictorSpec = field(default_factory=PredictorSpec)
    profile_batches: int = 2  # traces: batches held out for the hot table; synthetic: see profile_sequences
    profile_sequences: Optional[int] = 32  # synthetic: prompts of the profiling run (None: profile_batches batches)
    profile_seed: int = 1000
    seed: int = 0
    check_invariants: bool = False
    cache_slots: Optional[int] = None  # override the memory plan's expert-cache size (small studies)
    predictor_config: Any = None  # a `predictor` config node: built by predictors.load_predictor (overrides `predictor`)

    def with_scheduler(self, settings: SchedulerSettings) -> "RunSpec":
        return replace(self, scheduler=settings)


@dataclass
class PreparedRouting:
    trace: RoutingTrace
    passes: list[ForwardPass]
    profile: np.ndarray  # int64 [L, E] profiling loads for the hot table


def prepare_routing(spec: RunSpec) -> PreparedRouting:
    """The routing to replay and the profiling loads, from the spec's routing source."""
    cfg, r = spec.model, spec.routing
    if r.source == "synthetic":
        router = SyntheticRouter.for_model(cfg, r.synthetic, model_seed=r.model_seed, model_name=spec.model_name)
        trace = router.trace(spec.batch_size, spec.prompt_len, spec.gen_len, seed=spec.seed,
                             num_batches=spec.num_batches)
        if spec.profile_sequences:
            prof = router.trace(spec.profile_sequences, spec.prompt_len, spec.gen_len, seed=spec.seed + spec.profile_seed)
        else:
            prof = router.trace(spec.batch_size, spec.prompt_len, spec.gen_len, seed=spec.seed + spec.profile_seed,
                                num_batches=max(spec.profile_batches, 1))
        return PreparedRouting(trace, forward_passes(trace), profile_loads(prof))
    trace = load_routing_file(r, cfg)
    if sequences_per_batch(trace) != spec.batch_size:
        trace = batch_sequences(trace, spec.batch_size)
    passes = forward_passes(trace)
    batches = sorted({p.batch_id for p in passes})
    held = set(batches[:spec.profile_batches]) if len(batches) > spec.profile_batches else set()
    prof_rows = [p.rows for p in passes if p.batch_id in held]
    kept = [b for b in batches if b not in held][:max(spec.num_batches, 1)]  # replay num_batches batches
    replay = [p for p in passes if p.batch_id in set(kept)]
    profile = trace.expert_loads(np.concatenate(prof_rows)) if prof_rows else trace.expert_loads()
    for i, p in enumerate(replay):
        p.index = i
    return PreparedRouting(trace, replay, profile)


def load_routing_file(r: RoutingSpec, cfg: ModelConfig) -> RoutingTrace:
    """A recorded (.npz) or imported (JSONL) trace, checked against the model's shape."""
    from core.config import resolve_path
    from core.trace import load_trace

    if r.path is None:
        raise ValueError(f"routing.path: required for routing.source={r.source}")
    path = resolve_path(r.path)
    if r.source == "jsonl":
        from core.trace_import import import_vllm_jsonl

        trace = import_vllm_jsonl(path, num_experts=cfg.num_experts)
    else:
        trace = load_trace(path, with_hidden=False)
    if trace.meta.num_experts != cfg.num_experts or trace.meta.top_k != cfg.num_experts_per_tok:
        raise ValueError(f"routing.path: {path} routes {trace.meta.num_experts} experts top-{trace.meta.top_k}, "
                         f"the model has {cfg.num_experts} top-{cfg.num_experts_per_tok}")
    if trace.num_layers != len(cfg.moe_layers):
        trace = tile_layers(trace, len(cfg.moe_layers))
    return trace


def tile_layers(trace: RoutingTrace, num_layers: int) -> RoutingTrace:
    """A trace with `num_layers` MoE layers made by cycling the recorded layers (a shallow model's
    routing replayed on a deeper model of the same expert count and top-k); meta notes it."""
    from core.trace import TraceMeta

    idx = np.arange(num_layers) % trace.num_layers
    meta = TraceMeta(model=trace.meta.model, num_experts=trace.meta.num_experts, top_k=trace.meta.top_k,
                     moe_layers=tuple(range(num_layers)), hidden_size=trace.meta.hidden_size,
                     family=trace.meta.family, source=trace.meta.source,
                     extra={**trace.meta.extra, "tiled_from_layers": trace.num_layers})
    return RoutingTrace(meta=meta, experts=trace.experts[idx], weights=trace.weights[idx], step=trace.step,
                        batch=trace.batch, seq=trace.seq, pos=trace.pos, token=trace.token, phase=trace.phase)


def make_predictors(spec: RunSpec, trace: RoutingTrace) -> dict[int, Any]:
    """Predictor objects by distance: the noisy oracle for as far as the scheduler may look."""
    p, s = spec.predictor, spec.scheduler
    if p.kind == "none" or not s.use_predictor:
        return {}
    window = s.forecast_window
    if spec.predictor_config is not None:
        from predictors import load_predictor

        return {d: load_predictor(spec.predictor_config, trace=trace, distance=d) for d in range(1, window + 1)}
    return {d: NoisyOraclePredictor(trace, distance=d, hit_rate=p.hit_rate * p.distance_decay ** (d - 1),
                                    seed=p.seed + 7919 * d) for d in range(1, window + 1)}


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
    mem = memory_plan(spec.model, spec.hardware, spec.batch_size, spec.prompt_len, spec.gen_len,
                      staging_slots=spec.scheduler.staging_slots, bytes_per_param=spec.bytes_per_param)
    if spec.cache_slots is not None:
        mem = replace(mem, cache_slots=int(spec.cache_slots))
    cost = CostModel(spec.model, spec.hardware, model_name=spec.model_name, bytes_per_param=spec.bytes_per_param)
    setup = SchedulerSetup(num_layers=len(spec.model.moe_layers), num_experts=spec.model.num_experts,
                           top_k=spec.model.num_experts_per_tok, cache_slots=mem.cache_slots, cost=cost,
                           profile_loads=routing.profile)
    scheduler = build_scheduler(spec.scheduler, setup)
    predictors = make_predictors(spec, routing.trace)
    book = ForecastBook(routing.trace, predictors) if predictors else None
    sim = PipelineSim(cfg=spec.model, cost=cost, scheduler=scheduler, cache_slots=mem.cache_slots,
                      staging_slots=spec.scheduler.staging_slots, trace=routing.trace, forecasts=book,
                      options=SimOptions(async_io=spec.async_io, check_invariants=spec.check_invariants,
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
    return RunOutcome(spec, summary, mem, cost, sim)


def spec_from_config(cfg: Any) -> RunSpec:
    """A `RunSpec` from a composed `simulate` config (DictConfig)."""
    from omegaconf import OmegaConf

    from core.config import to_frozen
    from models.loading import resolve_model_config

    routing = cfg.routing
    source = routing.source.value if hasattr(routing.source, "value") else str(routing.source)
    return RunSpec(
        model=resolve_model_config(cfg.model), model_name=str(cfg.model.name),
        hardware=composed_profile(cfg.hardware)[0], scheduler=scheduler_settings(cfg.scheduler),
        routing=RoutingSpec(source=source, name=str(routing.name), path=routing.path, model_seed=int(routing.model_seed),
                            synthetic=to_frozen(routing.synthetic, SyntheticRoutingParams)),
        batch_size=int(cfg.batch_size), prompt_len=int(cfg.prompt_len), gen_len=int(cfg.gen_len),
        num_batches=int(cfg.num_batches), bytes_per_param=int(cfg.bytes_per_param), async_io=bool(cfg.async_io),
        predictor=PredictorSpec(kind=str(cfg.predictor.name), hit_rate=float(cfg.predictor.oracle.hit_rate),
                                distance_decay=float(cfg.predictor.oracle.distance_decay), seed=int(cfg.predictor.seed)),
        predictor_config=cfg.predictor,
        profile_batches=int(cfg.hot_table.profile_batches), profile_sequences=cfg.hot_table.profile_sequences,
        profile_seed=int(cfg.hot_table.seed), seed=int(cfg.seed),
        check_invariants=bool(cfg.check_invariants),
        cache_slots=OmegaConf.select(cfg, "cache_slots", default=None))
