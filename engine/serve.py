"""`python -m engine.serve` (`moescope-serve`): serverless experts (MoEless) on an Azure trace.

    python -m engine.serve                                   # simulate: Mixtral-8x7B on 8x A6000, 4 systems
    python -m engine.serve model=phi35_moe experiments=[compare,memory,distance,cv_threshold,ablation]
    python -m engine.serve mode=real model=tiny_mixtral serverless=tiny workload.azure.max_context_tokens=16

Simulate mode replays the trace's per-second batches (prefill, then decode iterations with the
trace's token counts) with routing from the synthetic generator or a recorded trace, and prices
every MoE layer with the MoEless §3.3 latency / cost model; real mode runs a small model on the
devices through the shard_map expert-parallel executor and checks its outputs against the
in-memory experts. Writes results.json, the figures of MoEless §6 (PNG) and wandb logs.

Multi-host (real mode): start one process per host with the same command plus
`distributed.coordinator=host0:1234 distributed.num_processes=N distributed.process_id=i`
(see `engine/serverless/multihost.py`); the `ep` mesh then spans every process's devices.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core.config import to_frozen
from conf import hydra_task
from schedulers.hardware import composed_profile
from conf.schemas.serve import ServeConfig, ServeMode
from core.telemetry import Telemetry


def azure_batches(cfg: ServeConfig) -> tuple[list, dict]:
    """The non-empty per-interval batches of the configured Azure trace slice, and its summary."""
    from engine.workloads.build import azure_trace

    wl = cfg.workload
    if wl.kind.value != "azure":
        raise ValueError(f"workload.kind: serve replays an Azure trace, got {wl.kind.value!r} (use workload=azure_conv "
                         "or azure_code)")
    trace = azure_trace(wl.azure, wl.seed)
    batches = list(trace.per_interval(wl.azure.interval_s).nonempty())
    if cfg.max_batches is not None:
        batches = batches[:cfg.max_batches]
    if not batches:
        raise ValueError("workload.azure: the selected trace slice has no requests")
    summary = {"name": trace.name, "requests": int(sum(b.num_requests for b in batches)), "batches": len(batches),
               "duration_s": trace.duration_s, "interval_s": wl.azure.interval_s,
               "context_tokens": int(sum(b.prefill_tokens for b in batches)),
               "generated_tokens": int(sum(b.decode_tokens for b in batches))}
    return batches, summary


def serving_trace(cfg: ServeConfig, node: DictConfig, model_cfg, batches: list, tm: Telemetry):
    """Routing for the batches: recorded from a trained checkpoint serving the replay, synthetic
    (per request / per decode step), or a recorded trace file."""
    from engine.serverless.serving_trace import from_routing_trace, replay_with_synthetic_routing
    from engine.sim.run import RoutingSpec, load_routing_file, tile_layers
    from engine.synthetic_routing import SyntheticRouter, SyntheticRoutingParams

    if cfg.routing_checkpoint:
        from engine.serverless.model_routing import record_replay_routing

        trace, starts = record_replay_routing(cfg.routing_checkpoint, cfg.workload, cfg.max_batches, cfg.seed,
                                              progress=tm.progress)
        if (trace.meta.num_experts, trace.meta.top_k) != (model_cfg.num_experts, model_cfg.num_experts_per_tok):
            raise ValueError(f"routing_checkpoint: {cfg.routing_checkpoint} routes {trace.meta.num_experts} experts "
                             f"top-{trace.meta.top_k}; model {cfg.model.name} has {model_cfg.num_experts} top-"
                             f"{model_cfg.num_experts_per_tok}")
        trace.save(tm.run_dir / "routing_trace.npz")
        if trace.num_layers != len(model_cfg.moe_layers):
            trace = tile_layers(trace, len(model_cfg.moe_layers))
        return from_routing_trace(trace, batch_times=starts, decode_stride=cfg.decode_stride,
                                  source=f"{cfg.routing_checkpoint} on azure:{cfg.workload.name}")
    r = cfg.routing
    if r.source.value == "synthetic":
        params = to_frozen(node.routing.synthetic, SyntheticRoutingParams)
        router = SyntheticRouter.for_model(model_cfg, params, model_seed=r.model_seed, model_name=str(cfg.model.name))
        return replay_with_synthetic_routing(batches, router, seed=cfg.seed, decode_stride=cfg.decode_stride,
                                             source=f"azure:{cfg.workload.name}")
    trace = load_routing_file(RoutingSpec(source=r.source.value, name=r.name, path=r.path), model_cfg)
    return from_routing_trace(trace, seconds_per_batch=cfg.workload.azure.interval_s, decode_stride=cfg.decode_stride,
                              source=r.path)


def experiment_results(outputs: dict, cache: dict) -> dict:
    """results.json's `experiments` block: per experiment the systems' summaries (+ CDFs, sweeps)."""
    from engine.serverless.simulator import cdf_points

    out: dict[str, Any] = {}
    for exp, pairs in outputs.items():
        block: dict[str, Any] = {"systems": {spec.label: res.summary() for spec, res in pairs}}
        if exp in ("compare", "ablation"):
            block["cdf"] = {}
            for spec, res in pairs:
                x, p = cdf_points(res.moe_s * 1e3, res.w())
                block["cdf"][spec.label] = {"x_ms": x, "p": p}
        if exp == "compare":
            block["balancedness_per_layer"] = {spec.label: res.balancedness_per_layer() for spec, res in pairs}
        if exp == "distance":
            block["values"] = [spec.distance for spec, _ in pairs]
        if exp == "cv_threshold":
            block["values"] = [spec.settings.cv_threshold for spec, _ in pairs]
        out[exp] = block
    return out


def run_simulation(cfg: ServeConfig, node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    from engine.serverless.experiments import compare_with_paper, default_specs, run_experiments, system
    from engine.serverless.latency_model import LatencySettings, ServerlessCostModel
    from engine.serverless.policies import build_policy, slots_per_device
    from models.loading import resolve_model_config
    from predictors import load_predictor

    model_cfg = resolve_model_config(node.model)
    hw, hw_defaults = composed_profile(node.hardware)
    sv = cfg.serverless
    G = sv.num_devices or hw.num_devices
    lat = sv.latency
    cost_model = ServerlessCostModel(model_cfg, hw, G, LatencySettings(lat.kind, lat.compute, lat.misc_s,
                                                                       lat.bill_keep_alive), sv.bytes_per_param)
    if sv.forecast.use_predictor and cfg.predictor.kind.value != "oracle":
        raise ValueError(f"predictor={cfg.predictor.name}: simulate mode replays routing without the model's "
                         "hidden states; use predictor=oracle (degraded by predictor.oracle.hit_rate) here and "
                         "gate / moeless predictors in mode=real")

    def make_predictor(d: int):
        return load_predictor(node.predictor, trace=trace.routing, distance=d) if sv.forecast.use_predictor else None

    E = model_cfg.num_experts
    base = default_specs(sv, E, G, cfg.predictor.distance)
    for spec in base.values():  # bad settings fail here, before any routing is generated
        build_policy(spec, E, G, cost_model.expert_bytes)
    for kind in cfg.systems:  # an unknown system fails here too
        system(base, kind)
    order = [*cfg.systems, *(kind for kind in base if kind not in cfg.systems)]  # results: the compared ones first
    batches, workload = azure_batches(cfg)
    trace = serving_trace(cfg, node, model_cfg, batches, tm)
    experiments = [e.value for e in cfg.experiments]
    outputs, cache = run_experiments(trace, cost_model, experiments, base, list(cfg.systems), sv.sweeps,
                                     make_predictor, sv.forecast.history_decay, progress=tm.progress)
    results: dict[str, Any] = {
        "mode": "simulate", "model": str(cfg.model.name), "hardware": hw.name, "hardware_defaults": hw_defaults, "num_devices": G,
        "workload": workload, "routing": trace.source if cfg.routing_checkpoint else cfg.routing.name,
        "steps_simulated": trace.num_steps, "iterations": float(trace.weight.sum()), "decode_stride": cfg.decode_stride,
        "tokens_routed": int(trace.routing.num_rows),
        "cost_model": cost_model.summary(), "latency": {"kind": lat.kind.value, "compute": lat.compute.value,
                                                        "other_compute": "device_sum" if lat.compute.value == "replica_max" else "replica_max"},
        "slots_per_device": {base[kind].label: slots_per_device(base[kind], E, G) for kind in order},
        "predictor": {"name": cfg.predictor.name, "used": sv.forecast.use_predictor, "hit_rate_by_distance": {
            str(key[1]): float(np.mean(list(v[1].values()))) for key, v in cache.items() if key[0] == "predictor" and v[1]}},
        "lossy_systems": sorted({spec.label for pairs in outputs.values() for spec, res in pairs if res.lossy}),
        "experiments": experiment_results(outputs, cache),
    }
    if "compare" in results["experiments"]:
        results["versus_paper"] = compare_with_paper(results["experiments"]["compare"]["systems"],
                                                     {kind: spec.label for kind, spec in base.items()})
    for exp, block in results["experiments"].items():
        tm.log({f"{exp}/{label}/{k}": v for label, s in block["systems"].items() for k, v in s.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return results


def run_real(cfg: ServeConfig, node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    from engine.serverless.executor import ServerlessExecutor
    from engine.serverless.experiments import default_specs, system
    from engine.serverless.forecast import LoadForecast
    from engine.serverless.real_serving import ep_mesh, place_model, serve_real
    from models.loading import load_model
    from predictors import load_predictor
    from predictors.historical_load import HistoricalLoadForecaster

    sv = cfg.serverless
    if sv.forecast.use_predictor and cfg.predictor.kind.value == "oracle":
        raise ValueError("predictor=oracle: the oracle reads a recorded trace and works in mode=simulate only; "
                         "use predictor=gate (or a trained predictor.checkpoint), or serverless.forecast.use_predictor=false")
    model_cfg, model, _ = load_model(node.model, dtype=cfg.dtype.value, seed=cfg.seed)
    mesh = ep_mesh(sv.num_devices)
    G = int(np.asarray(mesh.devices).size)
    place_model(model, mesh)
    batches, workload = azure_batches(cfg)
    base = default_specs(sv, model_cfg.num_experts, G, cfg.predictor.distance)
    systems: dict[str, Any] = {}
    specs = [system(base, kind) for kind in cfg.systems]  # unknown systems fail before anything is served
    for spec in specs:
        predictor = load_predictor(node.predictor, model=model) if sv.forecast.use_predictor else None
        forecast = LoadForecast(predictor, HistoricalLoadForecaster(len(model_cfg.moe_layers), model_cfg.num_experts,
                                                                    sv.forecast.history_decay), model_cfg.num_experts_per_tok)
        executor = ServerlessExecutor(model_cfg, mesh, spec, forecast, dispatch=sv.dispatch)
        out = serve_real(model, mesh, batches, executor, seed=cfg.seed, verify=cfg.verify, progress=tm.progress)
        systems[spec.label] = out.summary()
        tm.log({f"real/{spec.label}/{k}": v for k, v in systems[spec.label].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {"mode": "real", "model": str(cfg.model.name), "num_devices": G, "dispatch": sv.dispatch.value,
            "workload": workload, "systems": systems,
            "lossy_systems": sorted(label for label, s in systems.items() if s["lossy"])}


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The scalars, each system's mean MoE time and cost (simulate) or token equality (real)."""
    flat = {k: v for k, v in results.items() if not isinstance(v, (dict, list))}
    experiments = results.get("experiments")
    compare = experiments.get("compare", {}) if isinstance(experiments, dict) else {}
    for label, s in compare.get("systems", {}).items():
        flat[f"{label}: mean MoE ms"] = s["mean_moe_ms"]
        flat[f"{label}: cost GiB*s"] = s["total_cost_gib_s"]
    systems = results.get("systems")
    for label, s in (systems.items() if isinstance(systems, dict) else ()):
        if isinstance(s, dict) and "tokens_equal" in s:
            flat[f"{label}: tokens equal"] = s["tokens_equal"]
    return flat


@hydra_task("serve", summarize=headline)
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    """Serve or simulate as `node` (a composed `serve` config) says."""
    from engine.serverless.figures import close, draw_all
    from engine.serverless.multihost import maybe_initialize

    maybe_initialize(node)
    cfg: ServeConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    if cfg.decode_stride < 1:
        raise ValueError(f"decode_stride: must be >= 1, got {cfg.decode_stride}")
    results = run_simulation(cfg, node, tm) if cfg.mode is ServeMode.simulate else run_real(cfg, node, tm)
    if cfg.plots and cfg.mode is ServeMode.simulate:
        figs = draw_all(results, f"{results['model']}, {results['workload']['name']} trace")
        for name, fig in figs.items():
            tm.save_figure(fig, name)
        close(figs)
    return results


run = main.run  # in-process: run(node, run_dir=None), outputs in run_dir (default: the Hydra run folder)


if __name__ == "__main__":
    main()
