"""`python -m engine.serve` (`moescope-serve`): serverless experts (MoEless) on an Azure trace.

    python -m engine.serve                                   # simulate: Mixtral-8x7B on 8x A6000, 4 systems
    python -m engine.serve model=phi35_moe experiments=[compare,memory,distance,cv_threshold,ablation]
    python -m engine.serve mode=real model=tiny_mixtral serverless=tiny predictor=gate max_batches=2 workload.azure.max_context_tokens=16
    # MoEless's trained predictor drives MoEless: routing + gate inputs recorded from mixtral-tiny (cached)
    python -m engine.serve routing_checkpoint=pkg:models/checkpoints/mixtral-tiny predictor=moeless_mixtral_tiny
    python -m engine.serve mode=real model=mixtral_tiny serverless=tiny predictor=moeless_mixtral_tiny max_batches=2 \
        workload.azure.max_context_tokens=64 workload.azure.max_generated_tokens=8
    # (real mode runs eagerly on host devices: uncapped Azure contexts can keep one device in an op past XLA's
    # 600-s collective timeout, which aborts the process)

Simulate mode replays the trace's per-second batches (prefill, then decode iterations with the
trace's token counts) with routing from the synthetic generator or a recorded trace, and prices
every MoE layer with the serverless latency / cost model (by default the offload simulator's CostModel per
replica, weight streaming included; `serverless.latency.kind=paper` for MoEless §3.3's compute-only
formula); real mode runs a small model on the devices through the shard_map expert-parallel executor and
checks it, teacher-forced, against the in-memory model within the bf16 envelope (requests longer than
`real_max_context_tokens` are refused before anything is served). Writes results.json, the figures of MoEless §6 (PNG) and wandb logs.

Multi-host (real mode): start one process per host with the same command plus
`distributed.coordinator=host0:1234 distributed.num_processes=N distributed.process_id=i`
(see `engine/serverless/multihost.py`); the `ep` mesh then spans every process's devices.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional


def host_devices_for_real_mode(argv: list[str], environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """`mode=real` spreads experts over G devices; XLA's CPU platform offers one unless
    XLA_FLAGS=--xla_force_host_platform_device_count=G is set before jax is imported. Sets it (G from
    `serverless.num_devices=`, else 8) when the command line asks for real mode, the flag is absent and
    the platform may be the CPU (JAX_PLATFORMS unset or naming cpu; the flag only adds host devices, an
    accelerator platform is untouched). Returns the flags set, or None."""
    if "mode=real" not in argv or "xla_force_host_platform_device_count" in environ.get("XLA_FLAGS", ""):
        return None
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.split(","):
        return None
    n = next((a.split("=", 1)[1] for a in argv if a.startswith("serverless.num_devices=")), "8")
    # G emulated devices share the host's cores, so one may reach a collective long after the others
    # (XLA:CPU aborts the process after 40 s by default)
    flags = (f"{environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n if n.isdigit() else 8} "
             "--xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
    environ["XLA_FLAGS"] = flags
    return flags


if "jax" not in sys.modules:  # before anything imports jax (the console script imports this module first)
    host_devices_for_real_mode(sys.argv[1:])

import dataclasses  # noqa: E402  (the imports below may import jax)
import re  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np
from omegaconf import DictConfig, OmegaConf

from conf import hydra_task
from conf.schemas.serve import ServeConfig, ServeMode
from core.config import resolve_path, to_frozen
from core.routing_stats import routing_fingerprint
from core.telemetry import Telemetry
from engine.studies import serve_study_node, serve_study_tags
from engine.serverless.experiments import compare_with_paper, default_specs, run_experiments, system
from engine.serverless.forecast import LoadForecast, TiledPredictor
from engine.serverless.latency_model import LatencySettings, ServerlessCostModel
from engine.serverless.model_routing import cached_replay_routing, checkpoint_positions, context_caps
from engine.serverless.multihost import maybe_initialize
from engine.serverless.policies import build_policy, slots_per_device
from engine.serverless.serving_trace import ServingTrace, from_routing_trace, replay_with_synthetic_routing
from engine.serverless.simulator import cdf_points
from engine.sim.routing import RoutingConfig, load_routing_file, tile_layers
from engine.synthetic_routing import SyntheticRouter
from engine.workloads.build import azure_trace
from models.loading import load_model, resolve_model_config
from predictors import load_predictor
from predictors.config import NEEDS_HIDDEN, PredictorConfig, PredictorKind
from predictors.historical_load import HistoricalLoadForecaster
from schedulers.hardware import HardwareProfile, composed_profile


def azure_batches(cfg: ServeConfig) -> tuple[list, dict]:
    """The non-empty per-interval batches of the configured Azure trace slice, and its summary."""
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


def apply_context_caps(cfg: ServeConfig, positions: Optional[int]) -> Optional[dict[str, Any]]:
    """Cap every request's prompt and output so that they fit a model of `positions` positions (the
    routing checkpoint's in simulate mode, the served model's in real mode; `model_routing.context_caps`),
    in `cfg.workload` itself, so every system runs the lengths that were served. Returns what was capped."""
    if positions is None or cfg.workload.kind.value != "azure":
        return None
    az = cfg.workload.azure
    before = azure_trace(az, cfg.workload.seed)
    ctx, gen = context_caps(positions, az.max_context_tokens, az.max_generated_tokens)
    az.max_context_tokens, az.max_generated_tokens = ctx, gen
    after = azure_trace(az, cfg.workload.seed)
    capped = int(((before.context_tokens > ctx) | (before.generated_tokens > gen)).sum())
    return {"model_positions": positions, "max_context_tokens": ctx, "max_generated_tokens": gen,
            "requests_capped": capped, "requests": int(before.num_requests),
            "context_tokens_uncapped": int(before.context_tokens.sum()),
            "context_tokens_capped": int(after.context_tokens.sum()),
            "generated_tokens_uncapped": int(before.generated_tokens.sum()),
            "generated_tokens_capped": int(after.generated_tokens.sum()),
            "note": f"prompt + output of every request capped at the model's {positions} positions, for every system"}


def serving_trace(cfg: ServeConfig, model_cfg, batches: list, tm: Telemetry, with_hidden: bool = False
                  ) -> tuple[Any, dict[str, Any]]:
    """Routing for the batches: recorded from a trained checkpoint serving the replay (cached under
    runs/routing_cache), synthetic (per request / per decode step), or a recorded trace file.

    Returns the `ServingTrace` and a description of its routing for results.json; with a checkpoint
    and `with_hidden`, the description also holds "hidden" (float16 [R, N, H]: the recorded gate
    inputs of the replayed rows) and "recorded_layers" R, for predictors that read gate inputs.
    """
    if cfg.routing_checkpoint:
        trace, starts, cache = cached_replay_routing(cfg.routing_checkpoint, cfg.workload, cfg.max_batches, cfg.seed,
                                                     progress=tm.progress, with_hidden=with_hidden)
        if (trace.meta.num_experts, trace.meta.top_k) != (model_cfg.num_experts, model_cfg.num_experts_per_tok):
            raise ValueError(f"routing_checkpoint: {cfg.routing_checkpoint} routes {trace.meta.num_experts} experts "
                             f"top-{trace.meta.top_k}; model {cfg.model.name} has {model_cfg.num_experts} top-"
                             f"{model_cfg.num_experts_per_tok}")
        dataclasses.replace(trace, hidden=None).save(tm.run_dir / "routing_trace.npz")
        source = f"{cfg.routing_checkpoint} on azure:{cfg.workload.name}"
        st = from_routing_trace(trace, batch_times=starts, decode_stride=cfg.decode_stride, source=source)
        info: dict[str, Any] = {"kind": "recorded", "checkpoint": cfg.routing_checkpoint, "recorded_layers": trace.num_layers,
                                "cache": cache}
        if with_hidden:
            info["hidden"] = st.routing.hidden
        L = len(model_cfg.moe_layers)
        if trace.num_layers != L:
            info["tiled"] = f"{L} simulated MoE layers cycle through the {trace.num_layers} recorded ones"
            st = ServingTrace(routing=tile_layers(st.routing, L), time_s=st.time_s, weight=st.weight, phase=st.phase,
                              batch=st.batch, num_seqs=st.num_seqs, context=st.context, source=source)
        return st, info
    r = to_frozen(cfg.routing, RoutingConfig)
    if r.source.value == "synthetic":
        params = r.synthetic
        router = SyntheticRouter.for_model(model_cfg, params, model_seed=r.model_seed, model_name=str(cfg.model.name))
        st = replay_with_synthetic_routing(batches, router, seed=cfg.seed, decode_stride=cfg.decode_stride,
                                           source=f"azure:{cfg.workload.name}")
        return st, {"kind": "synthetic", "preset": r.name, "model_seed": r.model_seed,
                    "params": dataclasses.asdict(params)}
    trace = load_routing_file(r, model_cfg)
    st = from_routing_trace(trace, seconds_per_batch=cfg.workload.azure.interval_s, decode_stride=cfg.decode_stride,
                            source=r.path)
    return st, {"kind": r.source.value, "path": r.path}


def experiment_results(outputs: dict, cache: dict) -> dict:
    """results.json's `experiments` block: per experiment the systems' summaries (+ CDFs, sweeps)."""
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


def checkpoint_at_distance(checkpoint: str, distance: int) -> str:
    """`predictors.train` saves one folder per distance, `<name>_d<d>`: the sibling for `distance` (sweeps)."""
    folder = resolve_path(checkpoint)
    m = re.fullmatch(r"(.*_d)(\d+)", folder.name)
    if m is None or int(m.group(2)) == distance:
        return checkpoint
    sibling = folder.with_name(f"{m.group(1)}{distance}")
    if not sibling.is_dir():
        raise ValueError(f"predictor.checkpoint={checkpoint}: no trained folder {sibling.name} beside it for distance "
                         f"{distance} (train it: python -m predictors.train ... distances=[...,{distance}])")
    return str(sibling)


def replayed_predictor(predictor: PredictorConfig, distance: int, replay: dict[str, Any], num_layers: int) -> Any:
    """A trained (or gate-copy) predictor run on the replayed routing and its recorded gate inputs; on a
    simulated model deeper than the recorded one, wrapped to map its cycled layers (`TiledPredictor`)."""
    model = None
    if predictor.checkpoint:
        predictor = dataclasses.replace(predictor, checkpoint=checkpoint_at_distance(predictor.checkpoint, distance))
    elif replay.get("checkpoint") and predictor.kind is PredictorKind.gate:
        model = load_model({"name": "router", "checkpoint": replay["checkpoint"]})[1]  # its routers are copied
    pred = load_predictor(predictor, model=model, distance=distance)
    R = int(replay.get("recorded_layers", num_layers))
    layers = getattr(pred, "num_layers", R)
    if layers != R:
        raise ValueError(f"predictor.checkpoint={predictor.checkpoint}: trained for {layers} MoE layers, the replayed "
                         f"routing was recorded from {R}")
    hidden = replay.get("hidden")
    if R == num_layers and hidden is None:
        return pred
    return TiledPredictor(pred, R, hidden)


def predictor_summary(cfg: ServeConfig, used: bool, cache: dict, num_layers: int) -> dict[str, Any]:
    """results.json's predictor block: what forecast MoEless's loads, and how well (measured per distance)."""
    p = cfg.predictor
    out: dict[str, Any] = {"name": p.name, "kind": p.kind.value, "used": used, "checkpoint": p.checkpoint,
                           "hit_rate_by_distance": {}, "layers_forecast_by_predictor": {}}
    if p.kind is PredictorKind.oracle:
        out["upper_bound"] = True
        out["note"] = (f"upper bound: the replayed routing itself, degraded to an assumed hit rate "
                       f"{p.oracle.hit_rate:g} at d = 1 (x{p.oracle.distance_decay:g} per extra layer)")
    for key, (_, hits) in cache.items():
        if key[0] == "predictor" and hits:
            out["hit_rate_by_distance"][str(key[1])] = float(np.mean(list(hits.values())))
            out["layers_forecast_by_predictor"][str(key[1])] = len(hits) / num_layers  # the rest: history
    return out


def run_simulation(cfg: ServeConfig, hardware: tuple[HardwareProfile, dict[str, object]], tm: Telemetry
                   ) -> dict[str, Any]:
    """Replay the trace through the MoEless cost model. `hardware`: `composed_profile`'s (profile, defaults taken)."""
    model_cfg = resolve_model_config(cfg.model)
    hw, hw_defaults = hardware
    sv = cfg.serverless
    G = sv.num_devices or hw.num_devices
    lat = sv.latency
    cost_model = ServerlessCostModel(model_cfg, hw, G, LatencySettings(lat.kind, lat.compute, lat.misc_s, lat.billing),
                                     sv.bytes_per_param)
    pkind = cfg.predictor.kind
    needs_hidden = sv.forecast.use_predictor and pkind in NEEDS_HIDDEN
    if needs_hidden and not cfg.routing_checkpoint:
        raise ValueError(f"predictor={cfg.predictor.name}: a {pkind.value} predictor reads layer l's gate inputs, which "
                         "synthetic or file routing does not have; record them with "
                         "routing_checkpoint=pkg:models/checkpoints/mixtral-tiny (and a predictor.checkpoint trained "
                         "by predictors.train on that model), or use predictor=oracle (an upper bound: the replayed "
                         "routing degraded to an assumed hit rate)")
    replay: dict[str, Any] = {}

    def make_predictor(d: int):
        if not sv.forecast.use_predictor:
            return None
        if pkind is PredictorKind.oracle:
            # the run's seed reaches the oracle's errors as it reaches the traffic (predictor.seed offsets it)
            oracle = dataclasses.replace(cfg.predictor, seed=cfg.predictor.seed + cfg.seed)
            return load_predictor(oracle, trace=trace.routing, distance=d)
        return replayed_predictor(cfg.predictor, d, replay, len(model_cfg.moe_layers))

    E = model_cfg.num_experts
    base = default_specs(sv, E, G, cfg.predictor.distance)
    for spec in base.values():  # bad settings fail here, before any routing is generated
        build_policy(spec, E, G, cost_model.expert_bytes)
    for kind in cfg.systems:  # an unknown system fails here too
        system(base, kind)
    order = [*cfg.systems, *(kind for kind in base if kind not in cfg.systems)]  # results: the compared ones first
    caps = apply_context_caps(cfg, checkpoint_positions(cfg.routing_checkpoint) if cfg.routing_checkpoint else None)
    batches, workload = azure_batches(cfg)
    trace, replay = serving_trace(cfg, model_cfg, batches, tm, with_hidden=needs_hidden)
    experiments = [e.value for e in cfg.experiments]
    outputs, cache = run_experiments(trace, cost_model, experiments, base, list(cfg.systems), sv.sweeps,
                                     make_predictor, sv.forecast.history_decay, progress=tm.progress)
    results: dict[str, Any] = {
        "mode": "simulate", "model": str(cfg.model.name), "hardware": hw.name, "hardware_defaults": hw_defaults, "num_devices": G,
        "workload": workload, "routing": trace.source if cfg.routing_checkpoint else cfg.routing.name,
        "steps_simulated": trace.num_steps, "iterations": float(trace.weight.sum()), "decode_stride": cfg.decode_stride,
        "tokens_routed": int(trace.routing.num_rows),
        "cost_model": cost_model.summary(), "latency": {"kind": lat.kind.value, "compute": lat.compute.value, "billing": lat.billing.value,
                                                        "other_compute": "device_sum" if lat.compute.value == "replica_max" else "replica_max"},
        "slots_per_device": {base[kind].label: slots_per_device(base[kind], E, G) for kind in order},
        "routing_detail": {**{k: v for k, v in replay.items() if k != "hidden"}, "context_caps": caps},
        "routing_statistics": routing_fingerprint(trace.routing),  # what the fitted presets are fitted on
        "predictor": predictor_summary(cfg, sv.forecast.use_predictor, cache, len(model_cfg.moe_layers)),
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


def check_real_devices(specs: list, num_experts: int, num_devices: int, mesh) -> None:
    """Every system fits the mesh before anything is served; a one-line fix where it does not."""
    platform = np.asarray(mesh.devices).reshape(-1)[0].platform
    for spec in specs:
        try:
            build_policy(spec, num_experts, num_devices, 1.0)
        except ValueError as err:
            hint = (f" mode=real found {num_devices} {platform} device(s): set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count=8 before jax is imported (python -m engine.serve sets "
                    f"it itself when the flag is absent), or choose serverless.num_devices" if platform == "cpu" else "")
            raise ValueError(f"{spec.label}: {err}.{hint}") from None


def check_real_context(batches: list, cap: int) -> None:
    """The longest request of the replay (prompt + output) within real mode's cap, before anything is served."""
    longest = max((int((b.context_tokens + b.generated_tokens).max()) for b in batches if b.num_requests), default=0)
    if longest > cap:
        raise ValueError(f"mode=real: a request of {longest} tokens (prompt + output) exceeds real_max_context_tokens="
                         f"{cap}; cap the replay with workload.azure.max_context_tokens / max_generated_tokens "
                         f"(the eager shard_map run of longer passes outlasts XLA's collective timeout)")


def run_real(cfg: ServeConfig, tm: Telemetry) -> dict[str, Any]:
    """Serve the trace's batches with a small model on the devices' expert-parallel mesh, each system in turn."""
    # why lazy: the expert-parallel layer brings jax and flax, which mode=simulate (every study job) never uses
    from engine.serverless.executor import ServerlessExecutor
    from engine.serverless.real_serving import ep_mesh, place_model, serve_real

    sv = cfg.serverless
    if sv.forecast.use_predictor and cfg.predictor.kind.value == "oracle":
        raise ValueError("predictor=oracle: the oracle reads a recorded trace and works in mode=simulate only; "
                         "use predictor=gate (or a trained predictor.checkpoint), or serverless.forecast.use_predictor=false")
    model_cfg, model, _ = load_model(cfg.model, dtype=cfg.dtype.value, seed=cfg.seed)
    mesh = ep_mesh(sv.num_devices)
    G = int(np.asarray(mesh.devices).size)
    place_model(model, mesh)
    caps = apply_context_caps(cfg, model_cfg.max_position_embeddings)
    batches, workload = azure_batches(cfg)
    check_real_context(batches, cfg.real_max_context_tokens)
    base = default_specs(sv, model_cfg.num_experts, G, cfg.predictor.distance)
    systems: dict[str, Any] = {}
    specs = [system(base, kind) for kind in cfg.systems]  # unknown systems fail before anything is served
    check_real_devices(specs, model_cfg.num_experts, G, mesh)
    pcfg = cfg.predictor
    if pcfg.checkpoint:  # a trained folder per distance: the one for predictor.distance
        pcfg = dataclasses.replace(pcfg, checkpoint=checkpoint_at_distance(pcfg.checkpoint, pcfg.distance))
    for spec in specs:
        predictor = load_predictor(pcfg, model=model) if sv.forecast.use_predictor else None
        forecast = LoadForecast(predictor, HistoricalLoadForecaster(len(model_cfg.moe_layers), model_cfg.num_experts,
                                                                    sv.forecast.history_decay), model_cfg.num_experts_per_tok)
        executor = ServerlessExecutor(model_cfg, mesh, spec, forecast, dispatch=sv.dispatch)
        out = serve_real(model, mesh, batches, executor, seed=cfg.seed, verify=cfg.verify, progress=tm.progress)
        systems[spec.label] = out.summary()
        if predictor is not None and getattr(predictor, "stats", None) is not None and predictor.stats.total:
            systems[spec.label]["predictor_hit_rate"] = predictor.stats.hit_rate()  # measured on the served tokens
        tm.log({f"real/{spec.label}/{k}": v for k, v in systems[spec.label].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {"mode": "real", "model": str(cfg.model.name), "num_devices": G, "dispatch": sv.dispatch.value,
            "workload": workload, "context_caps": caps, "systems": systems,
            "predictor": {"name": cfg.predictor.name, "kind": cfg.predictor.kind.value, "checkpoint": cfg.predictor.checkpoint,
                          "distance": cfg.predictor.distance, "used": sv.forecast.use_predictor},
            "lossy_systems": sorted(label for label, s in systems.items() if s["lossy"])}


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The scalars, each system's mean MoE time and cost (simulate) or token equality (real)."""
    flat = {k: v for k, v in results.items() if not isinstance(v, (dict, list))}
    experiments = results.get("experiments")
    compare = experiments.get("compare", {}) if isinstance(experiments, dict) else {}
    for label, s in compare.get("systems", {}).items():
        flat[f"{label}: mean MoE ms (copy waits incl.)"] = s["mean_moe_ms"]
        flat[f"{label}: of which copy wait ms"] = s.get("mean_copy_wait_ms", 0.0)
        flat[f"{label}: weight copies / GiB"] = f"{s.get('copies', 0):.4g} / {s.get('copies_gib', 0):.4g}"
        flat[f"{label}: warm-start rate"] = s.get("warm_start_rate", 1.0)
        for billing, c in s.get("cost_by_billing_gib_s", {}).items():
            mark = " (headline)" if billing == s.get("billing") else ""
            flat[f"{label}: cost GiB*s, {billing}{mark}"] = c
        if s.get("eplb_rebalances"):
            flat[f"{label}: rearrangements (all layers)"] = s["eplb_rebalances"]
    ours = results.get("versus_paper", {}).get("ours", {})
    for key, what in (("latency_reduction_vs_megatron", "latency vs Megatron-LM"), ("latency_reduction_vs_eplb",
                      "latency vs EPLB"), ("cost_reduction_vs_megatron", "cost vs Megatron-LM"),
                      ("cost_reduction_vs_oracle", "cost vs Oracle"), ("cost_reduction_vs_eplb", "cost vs EPLB")):
        if ours.get(key) is not None:  # the paper's reductions as changes: negative is MoEless ahead
            flat[f"MoEless {what} (change)"] = f"{-100 * ours[key]:+.1f} %"
    systems = results.get("systems")
    for label, s in (systems.items() if isinstance(systems, dict) else ()):
        if isinstance(s, dict) and "tokens_equal" in s:
            flat[f"{label}: tokens equal"] = s["tokens_equal"]
    return flat


@hydra_task("serve", summarize=headline, prepare=serve_study_node)
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    """Serve or simulate as `node` (a composed `serve` config) says: the one conversion of the node."""
    cfg: ServeConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    maybe_initialize(cfg)
    if cfg.decode_stride < 1:
        raise ValueError(f"decode_stride: must be >= 1, got {cfg.decode_stride}")
    if cfg.mode is ServeMode.simulate:
        # composed_profile reads the hardware node and the composition (which keys the defaults filled): once, here
        results = run_simulation(cfg, composed_profile(node.hardware), tm)
    else:
        results = run_real(cfg, tm)
    results.update(serve_study_tags(node))  # a serverless regimes job: its regime (engine.studies)
    if cfg.plots and cfg.mode is ServeMode.simulate:
        # why lazy: matplotlib (~0.35 s to import) loads only when figures are drawn, as in engine/sim/timeline.py
        from engine.serverless.figures import close, draw_all

        figs = draw_all(results, f"{results['model']}, {results['workload']['name']} trace")
        for name, fig in figs.items():
            tm.save_figure(fig, name)
        close(figs)
    return results


run = main.run  # in-process: run(node, run_dir=None), outputs in run_dir (default: the Hydra run folder)


if __name__ == "__main__":
    main()
