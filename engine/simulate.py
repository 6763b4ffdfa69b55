"""`python -m engine.simulate`: replay one offloaded generation in the discrete-event simulator.

Writes results.json (throughput, decode latency, prefill time, PCIe / CPU / GPU use, per-layer busy
and bubble times, cache / prefetch / predictor hit rates, bytes moved, memory plan, lower bound and
the distance to it), a timeline plot of one forward pass, and wandb logs (offline by default).
Figure-11 sweep: `python -m engine.simulate -m +experiment=fig11` (a study job per model and batch, see
engine.studies and conf/experiment/; any Hydra launcher), then `python -m engine.report runs/simulate/multirun/<date>`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from conf import hydra_task
from conf.schemas.simulate import SimulateConfig
from core.config import to_frozen
from core.telemetry import Telemetry
from engine.sim.bounds import exact_best_pass, lower_bound
from core.routing_stats import routing_fingerprint
from engine.sim.pipeline import PlanningCharge
from engine.sim.routing import RoutingConfig
from engine.sim.run import RunOutcome, RunSpec, forecast_distances, prepare_routing, simulate
from engine.sim.timeline import plot_timeline
from models.loading import expert_format, resolve_model_config
from predictors.config import PredictorKind
from schedulers.base import scheduler_settings
from schedulers.hardware import composed_profile


def spec_from_config(cfg: DictConfig) -> RunSpec:
    """The `RunSpec` of a composed `simulate` config: the one conversion of the Hydra node (the hardware profile
    reads which keys the composition set off the node, so it is converted here, not from the typed copy)."""
    sc: SimulateConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    resolved = dict(model=resolve_model_config(sc.model), model_name=str(sc.model.name), expert_format=expert_format(sc.model),
                    hardware=composed_profile(cfg.hardware)[0], scheduler=scheduler_settings(sc.scheduler),
                    routing=to_frozen(sc.routing, RoutingConfig), predictor=sc.predictor,
                    planning=to_frozen(sc.planning, PlanningCharge),
                    profile_batches=sc.hot_table.profile_batches, profile_sequences=sc.hot_table.profile_sequences,
                    profile_seed=sc.hot_table.seed)
    # the run's sizes and switches are the task's top-level keys of the same names (batch_size, seed, ...)
    same = {f.name: getattr(sc, f.name) for f in dataclasses.fields(RunSpec) if f.name not in resolved}
    return RunSpec(**resolved, **same)


def predictor_results(spec: RunSpec, out: RunOutcome) -> dict[str, Any]:
    """What results say about the forecasts: the predictor and its kind (the oracle labelled as the upper bound it
    is, with its target hit rate; a real predictor's hit rates are the measured ones in the summary)."""
    p = spec.predictor
    if p is None or not spec.scheduler.use_predictor:
        return {"predictor": "none", "predictor_kind": "none"}
    if p.kind is PredictorKind.oracle:
        targets = {str(d): p.oracle.at(d) for d in forecast_distances(spec)}
        return {"predictor": p.name, "predictor_kind": "oracle (upper bound)",
                "predictor_hit_rate_target": p.oracle.at(1), "predictor_hit_rate_target_by_distance": targets,
                "predictor_distance_decay": p.oracle.distance_decay,
                "predictor_hit_rate_source": p.oracle.provenance()}
    return {"predictor": p.name, "predictor_kind": p.kind.value, "predictor_checkpoint": p.checkpoint,
            "predictor_fitted_on": None if p.checkpoint else "routing held out of the replay",
            "predictor_distances": sorted(out.sim.forecasts.predictors) if out.sim.forecasts is not None else []}


def headline(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if not isinstance(v, (dict, list))}


def numbers(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@hydra_task("simulate", summarize=headline, metrics=numbers)
def main(cfg: DictConfig, tm: Telemetry) -> dict[str, Any]:
    if cfg.study.kind:  # a study multirun's job (conf/experiment/<study>.yaml): many replays, rows in results.json
        from engine.studies import study_job

        return study_job(cfg)
    spec = spec_from_config(cfg)
    routing = prepare_routing(spec)
    draw = {int(cfg.timeline.step)} if cfg.timeline.plot and int(cfg.timeline.step) < len(routing.passes) else set()
    out = simulate(spec, routing, record=bool(draw), record_passes=draw)
    summary = dict(out.summary)
    results: dict[str, Any] = {
        "model": spec.model_name, "expert_format": spec.expert_format, "hardware": spec.hardware.name,
        "hardware_defaults": composed_profile(cfg.hardware)[1], "scheduler": spec.scheduler.label,
        "scheduler_kind": spec.scheduler.kind, "routing": spec.routing.name, "batch_size": spec.batch_size,
        "routing_statistics": routing_fingerprint(routing.trace),  # what the fitted presets are fitted on
        "prompt_len": spec.prompt_len, "gen_len": spec.gen_len, "async_io": spec.async_io,
        "hot_table": spec.scheduler.hot_table, **predictor_results(spec, out),
        "memory": {k: v for k, v in dataclasses.asdict(out.memory).items()},
        **summary,
    }
    if cfg.bounds.lower_bound:
        t_io = out.cost.t_io if spec.async_io else out.cost.t_io_sync
        lb = lower_bound(spec.model, out.cost, routing.passes, out.memory.cache_slots + spec.scheduler.staging_slots, t_io)
        results["lower_bound_s"] = lb
        results["above_lower_bound"] = summary["total_s"] / lb - 1 if lb > 0 else float("nan")
    if cfg.bounds.oracle:
        first = next((p for p in routing.passes if not p.prefill), routing.passes[0])
        start = out.sim.scheduler.initial_residency()
        best, _ = exact_best_pass(spec.model, out.cost, routing.trace, first, getattr(out.sim.scheduler, "pinned", start),
                                  out.memory.cache_slots, spec.scheduler.staging_slots, spec.async_io, initial=start)
        results["oracle_first_decode_s"] = best
    for i, seconds in enumerate(out.sim.metrics.pass_s):
        tm.log({"pass_ms": seconds * 1e3}, step=i)
    if draw:
        fig = plot_timeline(out.sim.events, int(cfg.timeline.step), cfg.timeline.max_layers,
                            title=f"{spec.scheduler.label} - {spec.model_name} on {spec.hardware.name}, batch {spec.batch_size}")
        tm.save_figure(fig, "timeline.png")
    return results


if __name__ == "__main__":
    main()
