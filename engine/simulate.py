"""`python -m engine.simulate`: replay one offloaded generation in the discrete-event simulator.

Writes results.json (throughput, decode latency, prefill time, PCIe / CPU / GPU use, per-layer busy
and bubble times, cache / prefetch / predictor hit rates, bytes moved, memory plan, lower bound and
the distance to it), a timeline plot of one forward pass, and wandb logs (offline by default).
Figure-11 sweep: `python -m engine.simulate -m model=... hardware=v100_pcie3,a100_pcie4
batch_size=4,8,16,32,64 scheduler=presched,hybrimoe,... wandb.mode=disabled`, then
`python -m engine.report runs/simulate/multirun/<date>`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conf import hydra_task
from core.telemetry import Telemetry
from schedulers.hardware import composed_profile


def headline(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if not isinstance(v, (dict, list))}


def numbers(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@hydra_task("simulate", summarize=headline, metrics=numbers)
def main(cfg: Any, tm: Telemetry) -> dict[str, Any]:
    from engine.sim.bounds import exact_best_pass, lower_bound
    from engine.sim.run import prepare_routing, simulate, spec_from_config
    from engine.sim.timeline import plot_timeline

    spec = spec_from_config(cfg)
    routing = prepare_routing(spec)
    draw = {int(cfg.timeline.step)} if cfg.timeline.plot else set()
    out = simulate(spec, routing, record=bool(draw), record_passes=draw)
    summary = dict(out.summary)
    results: dict[str, Any] = {
        "model": spec.model_name, "hardware": spec.hardware.name,
        "hardware_defaults": composed_profile(cfg.hardware)[1], "scheduler": spec.scheduler.label,
        "scheduler_kind": spec.scheduler.kind, "routing": spec.routing.name, "batch_size": spec.batch_size,
        "prompt_len": spec.prompt_len, "gen_len": spec.gen_len, "async_io": spec.async_io,
        "hot_table": spec.scheduler.hot_table, "predictor": spec.predictor.kind if spec.scheduler.use_predictor else "none",
        "predictor_hit_rate_target": spec.predictor.hit_rate,
        "memory": {k: v for k, v in dataclasses.asdict(out.memory).items()},
        **summary,
    }
    if cfg.bounds.lower_bound:
        t_io = out.cost.t_io if spec.async_io else out.cost.t_io_sync
        lb = lower_bound(spec.model, out.cost, routing.passes, out.memory.cache_slots + spec.scheduler.staging_slots, t_io)
        results["lower_bound_s"] = lb
        results["above_lower_bound"] = summary["total_s"] / lb - 1 if lb > 0 else float("nan")
    if cfg.bounds.oracle:
        first = next(p for p in routing.passes if not p.prefill)
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
